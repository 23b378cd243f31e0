"""Helpers for the GPU tests: engines on CUDA sharing a HF model's weights, HF greedy references on the same
GPU, and a near-tie-aware greedy comparison that runs the reference where the model lives."""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from typing import Any

import torch

from ringserve.actors.engine.config import EngineConfig
from ringserve.actors.engine.scheduling.engine_core import EngineCore
from ringserve.actors.engine.execution_plan import resolve_execution
from ringserve.actors.engine.models.weights import model_from_hf

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
SMOLLM2_ENV = "RINGSERVE_SMOLLM2"  # a .gguf path or model name for the real SmolLM2 weights


def hf_on_gpu(hf_model: Any, dtype: torch.dtype) -> Any:
    """A copy of `hf_model` on CUDA in `dtype`."""
    return copy.deepcopy(hf_model).to("cuda", dtype).eval()


def gpu_engine(hf_model: Any, backend: str, dtype: torch.dtype, graphs: bool, **config: Any) -> EngineCore:
    """An EngineCore on CUDA with `hf_model`'s weights in `dtype`, CUDA graphs on or off, its model built with
    the execution plan the settings resolve to (as a server builds it)."""
    tensors = {k: v.to(dtype) for k, v in hf_model.state_dict().items()}
    settings: dict[str, Any] = dict(device="cuda", dtype=DTYPE_NAMES[dtype], attention_backend=backend,
                                    disable_cuda_graph=not graphs, max_total_tokens=8192, cuda_graph_max_bs=16)
    settings.update(config)
    engine_config = EngineConfig(**settings)
    plan = resolve_execution(engine_config)
    model = model_from_hf(hf_model.config, tensors, "cuda", plan)
    return EngineCore(model, engine_config, execution=plan)


@torch.no_grad()
def hf_greedy_gpu(hf_model: Any, prompt_ids: Sequence[int], max_new_tokens: int, eos: int | None) -> list[int]:
    """HF `generate(do_sample=False)` continuation on the model's device."""
    ids = torch.tensor([list(prompt_ids)], device=hf_model.device)
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                            max_new_tokens=max_new_tokens, eos_token_id=eos,
                            pad_token_id=eos if eos is not None else 0)
    return out[0, len(prompt_ids) :].tolist()


@torch.no_grad()
def assert_greedy_close(hf_model: Any, prompt_ids: Sequence[int], expected: Sequence[int], got: Sequence[int],
                        tol: float) -> None:
    """`got` equals `expected` except after a near-tie: at the first difference the reference's top-2 logits
    (prompt + agreed prefix) are those two tokens, less than `tol` apart. Nothing after it is compared."""
    expected, got = list(expected), list(got)
    if expected == got:
        return
    i = next((k for k, (a, b) in enumerate(zip(expected, got)) if a != b), None)
    assert i is not None, f"one output is a strict prefix of the other:\nexpected {expected}\ngot      {got}"
    ids = torch.tensor([list(prompt_ids) + expected[:i]], device=hf_model.device)
    top = hf_model(ids).logits[0, -1].float().topk(2)
    gap = float(top.values[0] - top.values[1])
    assert {expected[i], got[i]} == set(top.indices.tolist()) and gap < tol, (
        f"greedy mismatch at output position {i}: expected {expected[i]}, got {got[i]}; reference top-2 "
        f"{top.indices.tolist()} with logit gap {gap:.3g} (tolerated below {tol})\nexpected {expected}\ngot      {got}")


def smollm2_source() -> Any | None:
    """The real SmolLM2-135M-Instruct (`$RINGSERVE_SMOLLM2`, else the packaged GGUF), or None if absent."""
    from ringserve.actors.common.model_source import resolve_model

    try:
        import gguf  # noqa: F401  (transformers needs it to read GGUF files)

        return resolve_model(os.environ.get(SMOLLM2_ENV, "SmolLM2-135M-Instruct"))
    except (ImportError, FileNotFoundError):
        return None
