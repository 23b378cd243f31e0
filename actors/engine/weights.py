"""Build our Llama from Hugging Face weights: from a model on disk, or from an in-memory config + state dict.

Loading goes through transformers (`from_pretrained` handles GGUF de-quantization and safetensors alike);
we then take its config and state dict. Our model is built on the meta device and the tensors are assigned
into it, so no memory is spent on a random initialization.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from tqdm import tqdm

from actors.common.model_source import ModelSource
from actors.engine.llama import LlamaForCausalLM

SUPPORTED_MODEL_TYPES = ("llama",)


def load_model(source: ModelSource, dtype: torch.dtype, device: str | torch.device) -> LlamaForCausalLM:
    """Load `source` through transformers in `dtype`, then move it into our model on `device`."""
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(source.directory, dtype=dtype, **source.hf_kwargs())
    return model_from_hf(hf_model.config, hf_model.state_dict(), device)


def model_from_hf(
    config: Any, state_dict: Mapping[str, torch.Tensor], device: str | torch.device = "cpu"
) -> LlamaForCausalLM:
    """Our model holding the tensors of a HF Llama `state_dict` (shared, not copied, when already on `device`)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r}: only {SUPPORTED_MODEL_TYPES} are implemented")
    tensors = dict(state_dict)
    if config.tie_word_embeddings:
        tensors.setdefault("lm_head.weight", tensors["model.embed_tokens.weight"])
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    moved = {name: t.to(device) for name, t in tqdm(tensors.items(), desc="Loading weights into engine", unit="t")}
    model.load_state_dict(moved, strict=True, assign=True)
    model.tie_weights()
    return model.to(device).eval().requires_grad_(False)
