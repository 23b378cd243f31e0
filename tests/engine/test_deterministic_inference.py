"""`--enable-deterministic-inference`: a row's greedy result does not depend on how many rows share its step.

For every quantization mode (float32, int8, int4, the GGUF file's own blocks) and on both ISA paths of our
kernels (this host's own, and AVX2 forced as `RINGSERVE_CPU_ISA=avx2` does), one request's greedy tokens and
their logprobs are bit-identical run alone, in a batch of 8 (prefilled together, then decoded together) and
under n-gram speculation (its verify steps run several rows per request). The logprobs are compared exactly:
they are the row's logits, so any difference in a linear's, the attention's or a norm's arithmetic shows,
whether or not it flips a token. SmolLM2's GGUF (Q4_1 projections, Q8_0 head) cut to two layers keeps the
real shapes and blocks; Gemma 3's Q4_K_M (the K-quant kernels) likewise, on the native ISA, where asked for
(`RINGSERVE_TEST_GEMMA_DETERMINISM=1`: its engine takes minutes to build here).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import ringserve.kernels.cpu as cpu_kernels
from ringserve.actors.common.model_source import resolve_model
from ringserve.actors.engine.config import EngineConfig
from ringserve.actors.engine.scheduling.engine_core import EngineCore
from ringserve.bus.messages import TokenizedRequest
from tests.engine_helpers import greedy, run_to_completion
from tests.gguf_files import truncated_gguf

NEW_TOKENS = 24
MODES = ("none", "int8", "int4", "gguf")
ISAS = ("native", "avx2")
needs_kernels = pytest.mark.skipif(not cpu_kernels.compiled(), reason="our CPU kernels are not built here")
DETERMINISTIC: dict[str, Any] = {"enable_deterministic_inference": True}


def prompts() -> list[list[int]]:
    """Eight prompts of different lengths; the first repeats a phrase, so its n-gram drafts are accepted."""
    phrase = [504, 2031, 77, 9001, 311, 42, 1500, 863, 12, 4410]
    others = [[1, 300 + 37 * i, 88, 4000 + 11 * i, 2 + i, 640, 17 * i + 5][: 3 + i % 5] * (1 + i % 3) for i in range(7)]
    return [phrase * 3, *others]


@pytest.fixture(scope="module")
def smollm2_two_layers(tmp_path_factory: pytest.TempPathFactory) -> Any:
    source = resolve_model("SmolLM2-135M-Instruct")
    assert source.gguf_file is not None
    path = tmp_path_factory.mktemp("det") / "smollm2-2-layers.gguf"
    return resolve_model(str(truncated_gguf(Path(source.directory) / source.gguf_file, path, layers=2)))


@contextmanager
def kernels_isa(name: str) -> Iterator[str]:
    """Our kernels on the ISA path `name` ("native": this host's best; "avx2" forced, as `RINGSERVE_CPU_ISA=avx2`
    does), restored afterwards."""
    before = cpu_kernels.isa()
    cpu_kernels.set_isa(cpu_kernels.best_isa() if name == "native" else name)
    try:
        yield cpu_kernels.isa()
    finally:
        cpu_kernels.set_isa(before)


def outputs(engine: EngineCore, requests: list[TokenizedRequest]) -> tuple[list[int], list[float], int]:
    """The first request's tokens, their logprobs and the drafts accepted for it, the others run beside it."""
    rows = run_to_completion(engine, requests)[requests[0].rid]
    return ([t for r in rows for t in r.token_ids], [p for r in rows for p in r.logprobs],
            rows[-1].spec_accepted_tokens)


def assert_row_invariant(source: Any, quantization: str, isas: tuple[str, ...] = ISAS,
                         new_tokens: int = NEW_TOKENS) -> dict[str, str]:
    """On each ISA path, alone, in a batch of 8 and speculated, the first prompt's tokens and logprobs are
    identical (one engine: the row-invariant plan is the same on both paths); returns the engine's
    quantization report."""
    engine = EngineCore.from_source(source, EngineConfig(
        device="cpu", torch_threads=1, max_total_tokens=4096, quantization=quantization,
        speculative_algorithm="ngram", **DETERMINISTIC))

    def requests(tag: str, first: int, speculate: bool) -> list[TokenizedRequest]:
        return [TokenizedRequest(f"{tag}{i}", [first, *ids], greedy(new_tokens, ignore_eos=True, return_logprob=True,
                                                                    speculative=speculate))
                for i, ids in enumerate(prompts())]

    for first, name in enumerate(isas, start=7):  # each path its own prompts: no prefix cached by the other's
        with kernels_isa(name) as isa:
            alone = outputs(engine, requests(f"alone-{isa}-", first, False)[:1])
            batched = outputs(engine, requests(f"batch-{isa}-", first, False))  # its prompt cached by then
            speculated = outputs(engine, requests(f"spec-{isa}-", first, True)[:1])
        assert speculated[2] > 0, "no draft was accepted: the verify steps were not exercised"
        assert batched[:2] == alone[:2], f"{quantization} on {isa}: a batch of 8 changed the row"
        assert speculated[:2] == alone[:2], f"{quantization} on {isa}: speculation changed the row"
    return engine.stats().quantization


@needs_kernels
@pytest.mark.parametrize("quantization", MODES)
def test_a_rows_greedy_result_is_the_same_alone_batched_and_speculated(smollm2_two_layers: Any,
                                                                       quantization: str) -> None:
    report = assert_row_invariant(smollm2_two_layers, quantization)
    assert report["deterministic_inference"] == "on", report


@needs_kernels
@pytest.mark.skipif(os.environ.get("RINGSERVE_TEST_GEMMA_DETERMINISM") != "1",
                    reason="~4-7 min on 2 cores (its engine reads the 262k-row Q6_K embedding): "
                           "RINGSERVE_TEST_GEMMA_DETERMINISM=1 runs it; the K-quant kernels' row invariance is "
                           "tests/kernels/test_row_invariant_kernels.py's")
def test_gemma3s_k_quants_give_a_row_the_same_result_alone_batched_and_speculated(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Gemma 3 270M's Q4_K_M blocks (the K-quant kernels, a 262k-row head, sliding-window layers), two layers of
    it, on this host's ISA only (the K-quant kernels' AVX2 path: tests/kernels/test_row_invariant_kernels.py)."""
    from tests.real_models import gemma3_gguf

    path = truncated_gguf(gemma3_gguf(), tmp_path_factory.mktemp("det-gemma") / "gemma3-2-layers.gguf", layers=2)
    report = assert_row_invariant(resolve_model(str(path)), "gguf", isas=("native",), new_tokens=12)
    assert report["deterministic_inference"] == "on" and {"q4_k", "q6_k"} & set(report.values()), report


def test_the_flag_is_an_engine_flag_that_turns_off_the_cpus_decode_graphs_and_refuses_bfloat16() -> None:
    import argparse

    from torch import nn

    from ringserve.actors.engine.quantization.quantize import apply_quantization

    parser = argparse.ArgumentParser()
    EngineConfig.add_arguments(parser)
    config = EngineConfig.from_args(parser.parse_args(["--enable-deterministic-inference", "--device", "cpu"]))
    assert config.enable_deterministic_inference and config.to_argv() == ["--device", "cpu",
                                                                          "--enable-deterministic-inference"]
    assert config.graph_max_bs() == 0 and EngineConfig(device="cpu").graph_max_bs() > 0
    with pytest.raises(ValueError, match="--enable-deterministic-inference"):
        apply_quantization(nn.Linear(64, 64), EngineConfig(device="cpu", dtype="bfloat16",
                                                           enable_deterministic_inference=True))
