"""Build our Llama from Hugging Face weights: from a model on disk, or from an in-memory config + state dict.

Loading goes through transformers (`from_pretrained` handles GGUF de-quantization and safetensors alike);
we then take its config and state dict. De-quantizing a GGUF takes most of a cold start, so the result is
kept as safetensors (fused projections, in the load dtype) in the cache next to the converted tokenizer, and
a warm start reads that file directly. Our model is built on the meta device and the tensors are assigned
into it, so no memory is spent on a random initialization.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from actors.common.model_source import ModelSource, cache_root, gguf_cache_key, load_config, publish_directory
from actors.engine.llama import LlamaForCausalLM, fuse_hf_state_dict

SUPPORTED_MODEL_TYPES = ("llama",)
WEIGHTS_FILE = "model.safetensors"


def load_model(source: ModelSource, dtype: torch.dtype, device: str | torch.device) -> LlamaForCausalLM:
    """Load `source` in `dtype` onto `device`: from the weight cache when a GGUF was converted before."""
    from safetensors.torch import load_file

    cached = weight_cache_dir(source, dtype)
    if cached is not None and (cached / WEIGHTS_FILE).is_file():
        return model_from_hf(load_config(source), load_file(cached / WEIGHTS_FILE), device)
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(source.directory, dtype=dtype, **source.hf_kwargs())
    model = model_from_hf(hf_model.config, hf_model.state_dict(), device)
    if cached is not None:
        save_weights(model, cached)
    return model


def weight_cache_dir(source: ModelSource, dtype: torch.dtype) -> Path | None:
    """Where the converted weights of a GGUF `source` in `dtype` live (None for safetensors sources)."""
    if source.gguf_file is None:
        return None
    return cache_root() / "weights" / f"{gguf_cache_key(source)}-{str(dtype).removeprefix('torch.')}"


def save_weights(model: LlamaForCausalLM, directory: Path) -> None:
    """Write `model`'s tensors (a tied LM head once) as safetensors to `directory`, atomically."""
    from safetensors.torch import save_file

    tensors = {name: t.detach().to("cpu").contiguous() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=directory.parent, prefix=".staging-"))
    save_file(tensors, str(staging / WEIGHTS_FILE))
    publish_directory(staging, directory)


def model_from_hf(
    config: Any, state_dict: Mapping[str, torch.Tensor], device: str | torch.device = "cpu"
) -> LlamaForCausalLM:
    """Our model holding the tensors of a HF Llama `state_dict` (shared, not copied, when already on `device`).

    The state dict may already have fused projections (as our own saved weights do).
    """
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r}: only {SUPPORTED_MODEL_TYPES} are implemented")
    tensors = fuse_hf_state_dict(dict(state_dict), config.num_hidden_layers)
    if config.tie_word_embeddings:
        tensors.setdefault("lm_head.weight", tensors["model.embed_tokens.weight"])
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    moved = {name: t.to(device) for name, t in tqdm(tensors.items(), desc="Loading weights into engine", unit="t")}
    model.load_state_dict(moved, strict=True, assign=True)
    model.tie_weights()
    return model.to(device).eval().requires_grad_(False)
