"""Shared helpers for engine tests: a tiny random Llama, HF greedy references, and a near-tie-aware comparison.

The fixtures built on them (`hf`, `torch_single_thread`) live in tests/conftest.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from ringserve.actors.engine.config import EngineConfig
from ringserve.actors.engine.execution_plan import ExecutionPlan, resolve_execution
from ringserve.actors.engine.scheduling.engine_core import EngineCore
from ringserve.actors.engine.models.weights import model_from_hf
from ringserve.bus.messages import TokenizedRequest, SamplingParams, TokenRow


def tiny_hf_llama(vocab_size: int = 512, seed: int = 0, **overrides: Any) -> Any:
    """A 2-layer random HF `LlamaForCausalLM` (GQA 4/2 heads) with logits spread wide enough to avoid ties."""
    from transformers import LlamaConfig, LlamaForCausalLM

    settings: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.1,
        tie_word_embeddings=False,
        eos_token_id=2,
        bos_token_id=1,
        pad_token_id=0,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**settings)).eval()


def engine_for(hf_model: Any, tokenizer: Any | None = None, draft: EngineCore | None = None,
               build: ExecutionPlan | None = None, **config: Any) -> EngineCore:
    """An EngineCore sharing `hf_model`'s weights, on the CPU unless `device` says otherwise, its model built with
    the execution plan the config resolves to (as a server builds it), or with `build`'s norm and rotary kernels
    (the Triton ones on a CPU, under Triton's interpreter); `draft`: its draft model's engine (with
    `speculative_algorithm="draft"`)."""
    config.setdefault("device", "cpu")
    config.setdefault("torch_threads", 1)  # no thread tuner: its per-step thread switches change float rounding
    # A pool sized for the tests' prompts: the automatic size (a fifth of memory, up to every request at full
    # context) is a gigabyte for the tiny model, zeroed at construction and scanned by every integrity check.
    config.setdefault("max_total_tokens", 16384)
    engine_config = EngineConfig(**config)
    plan = resolve_execution(engine_config)
    if build is not None:
        plan = dataclasses.replace(plan, norm_rotary_kernels=build.norm_rotary_kernels)
    model = model_from_hf(hf_model.config, hf_model.state_dict(), config["device"], plan)
    return EngineCore(model, engine_config, tokenizer, draft=draft, execution=plan)


def greedy(max_new_tokens: int, **kwargs: Any) -> SamplingParams:
    """Greedy sampling parameters."""
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, **kwargs)


def run_to_completion(engine: EngineCore, requests: Sequence[TokenizedRequest]) -> dict[str, list[TokenRow]]:
    """Submit all `requests` at once and step until the engine is idle; returns each rid's rows in order.

    The KV pool's integrity is checked after every step.
    """
    for req in requests:
        assert engine.add_request(req) is None, req.rid
    rows: dict[str, list[TokenRow]] = {req.rid: [] for req in requests}
    while engine.has_work():
        for row in engine.step():
            rows.setdefault(row.rid, []).append(row)
        engine.check_integrity()
    return rows


def tokens_of(rows: Sequence[TokenRow]) -> list[int]:
    """All token ids of one request's rows, concatenated."""
    return [t for row in rows for t in row.token_ids]


@torch.no_grad()
def hf_greedy(hf_model: Any, prompt_ids: Sequence[int], max_new_tokens: int, eos_token_id: int | None) -> list[int]:
    """HF `generate(do_sample=False)` continuation of `prompt_ids` (stopping at `eos_token_id` if given)."""
    out = hf_model.generate(
        torch.tensor([list(prompt_ids)]),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id if eos_token_id is not None else 0,
    )
    return out[0, len(prompt_ids) :].tolist()


@torch.no_grad()
def assert_greedy_matches(
    hf_model: Any,
    prompt_ids: Sequence[int],
    expected_ids: Sequence[int],
    got_ids: Sequence[int],
    tol: float = 1e-3,
) -> None:
    """Assert `got_ids` equals HF's greedy `expected_ids`, except after a genuine near-tie.

    At the first position where the two differ, HF's logits (prompt + agreed prefix) must have their top-2
    within `tol` of each other and the two tokens must be exactly that top-2; anything after a tolerated
    divergence is not compared, since the sequences have forked.
    """
    expected, got = list(expected_ids), list(got_ids)
    if expected == got:
        return
    i = next((k for k, (a, b) in enumerate(zip(expected, got)) if a != b), None)
    assert i is not None, f"one output is a strict prefix of the other:\nexpected {expected}\ngot      {got}"
    logits = hf_model(torch.tensor([list(prompt_ids) + expected[:i]])).logits[0, -1].float()
    top = logits.topk(2)
    gap = float(top.values[0] - top.values[1])
    assert {expected[i], got[i]} == set(top.indices.tolist()) and gap < tol, (
        f"greedy mismatch at output position {i}: expected {expected[i]}, got {got[i]}; "
        f"HF top-2 {top.indices.tolist()} with logit gap {gap:.3g} (tolerated only below {tol})\n"
        f"expected {expected}\ngot      {got}"
    )


def load_hf_model(source: Any) -> Any:
    """transformers' own model for `source` (a ModelSource: GGUF or safetensors), float32 on the CPU, in eval
    mode: the ground truth every real-model greedy test compares against."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source.directory, dtype=torch.float32, **source.hf_kwargs())
    return model.eval()


def compiled_engine(hf_model: Any, monkeypatch: Any, max_bs: int = 1, timeout: float = 900.0) -> EngineCore:
    """An engine sharing `hf_model`'s weights whose CPU decode graph of batch size 1 is compiled (kept however it
    measures on a busy host, never stored) and serving: a fallback to eager fails the test."""
    monkeypatch.setenv("RINGSERVE_CPU_GRAPHS", "1")
    monkeypatch.setenv("RINGSERVE_GRAPH_STORE", "0")
    engine = engine_for(hf_model, max_total_tokens=1024, cuda_graph_max_bs=max_bs)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.compiler is not None, "the torch backend compiles CPU decode graphs"
    graphs.compiler.choose = False
    engine.start_decode_graphs()
    assert graphs.compiler.wait((1, 1), timeout)
    state = engine.stats().decode_graphs["bs 1, 1 thread"]
    assert state.startswith("compiled"), state
    return engine
