"""Every `--quantization` mode builds its decode graph compiled, whichever kernels its plan chose: the plan is
forced (each linear shape given another candidate, rather than the fastest measured), the batch-1 graph the
warm-up wants is compiled with eager fallbacks an error (tests/conftest.py), and its tokens equal the eager
engine's. Issue 37's int4 start, whose plan put fbgemm's `int_mm` on the LM head at one row, failed to compile
("Failed to convert args/kwargs to proxy") and ran eagerly unnoticed. The model is SmolLM2's own GGUF file cut
to its first two layers: every linear shape and block type of the real one, a fifteenth of the compile time."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import ringserve.kernels.linear_plan.measure as measure
import ringserve.kernels.quantization as quantization
from ringserve.actors.common.model_source import resolve_model
from ringserve.actors.engine.config import EngineConfig
from ringserve.actors.engine.runner.graphs.graph_compiler import FALLBACK_ENV, BackgroundCompiler, GraphFailed
from ringserve.actors.engine.scheduling.engine_core import EngineCore
from ringserve.bus.messages import TokenizedRequest
from ringserve.kernels import cpu as cpu_kernels
from ringserve.kernels.linear_plan import KernelPlan
from tests.engine_helpers import greedy, run_to_completion, tokens_of
from tests.gguf_files import truncated_gguf

pytestmark = pytest.mark.skipif(not cpu_kernels.compiled(), reason="compiled decode graphs need the CPU kernels")

COMPILE_TIMEOUT = 900.0  # one graph on a busy 2-core host
HEAD_OUT = 49152  # SmolLM2's vocabulary: the LM head's output features


def rotate(shape_index: int, bucket: int, kernels: list[str]) -> str:
    """Each shape and row bucket another of the candidates timed for it, so one model runs them all."""
    return kernels[(shape_index + bucket) % len(kernels)]


def forced_plan(choose: Callable[[int, int, int, list[str]], str]) -> Callable[..., KernelPlan]:
    """A `plan_from_times` that ignores the times: `choose(out, shape_index, bucket, candidates)` picks."""
    def plan_from_times(times: dict[str, dict[str, float]], _: Any) -> KernelPlan:
        shapes = sorted({tuple(int(v) for v in entry.split(",")[:2]) for entry in times})
        plan: KernelPlan = {}
        for entry, measured in times.items():
            n, k, rows = (int(v) for v in entry.split(","))
            index = shapes.index((n, k))
            plan.setdefault((n, k), {})[rows.bit_length()] = choose(n, index, rows.bit_length(), sorted(measured))
        return plan
    return plan_from_times


def everywhere(n: int, index: int, bucket: int, kernels: list[str]) -> str:
    return rotate(index, bucket, kernels)


def int_mm_on_the_head(n: int, index: int, bucket: int, kernels: list[str]) -> str:
    return "int_mm" if n == HEAD_OUT and "int_mm" in kernels else rotate(index, bucket, kernels)


@pytest.fixture(scope="module")
def two_layer_smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = resolve_model("SmolLM2-135M-Instruct")
    assert source.gguf_file is not None
    return truncated_gguf(Path(source.directory) / source.gguf_file,
                          tmp_path_factory.mktemp("smollm2-2") / "smollm2-2-layers.gguf", layers=2)


@pytest.fixture(autouse=True)
def graphs_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RINGSERVE_CPU_GRAPHS", "1")
    monkeypatch.setenv(FALLBACK_ENV, "error")


@pytest.mark.parametrize(("method", "choose"), [
    ("none", everywhere), ("int8", everywhere), ("int4", everywhere), ("int4", int_mm_on_the_head),
    ("gguf", everywhere), ("auto", int_mm_on_the_head)],
    ids=["none", "int8", "int4", "int4-int_mm-head", "gguf", "auto"])
def test_each_quantization_mode_compiles_its_batch_1_graph(method: str, choose: Any, two_layer_smollm2: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    plan = forced_plan(choose)
    monkeypatch.setattr(measure, "plan_from_times", plan)
    config = EngineConfig(device="cpu", torch_threads=1, max_total_tokens=2048, cuda_graph_max_bs=1,
                          quantization=method)
    engine = EngineCore.from_source(resolve_model(str(two_layer_smollm2)), config)
    kernels = set(engine.stats().quantization.values())
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.compiler is not None
    graphs.compiler.choose = False  # keep the compiled graph however it measures on this busy host
    prompt = [504, 3575, 282, 4649, 314, 7042, 30, 378, 3575, 282, 4521, 314]  # "The capital of France is Paris. The capital of Germany is"
    eager = tokens_of(run_to_completion(engine, [TokenizedRequest("eager", prompt, greedy(6))])["eager"])

    engine.start_decode_graphs()
    assert graphs.compiler.wait((1, 1), COMPILE_TIMEOUT)
    state = engine.stats().decode_graphs["bs 1, 1 thread"]
    assert state.startswith("compiled"), f"{method}: {state}; plan {engine.stats().quantization}"
    served = run_to_completion(engine, [TokenizedRequest("compiled", prompt, greedy(6))])["compiled"]
    assert tokens_of(served) == eager, f"{method} with kernels {sorted(kernels)}"
    if choose is int_mm_on_the_head and method == "int4":
        assert any(name.startswith(f"576->{HEAD_OUT} 1") and kernel == "int_mm"
                   for name, kernel in engine.stats().quantization.items()), engine.stats().quantization


class _Uncompilable(torch.nn.Module):
    """fbgemm's packed weight called directly: the TorchScript object Dynamo cannot trace (the int4 bug)."""

    def __init__(self) -> None:
        super().__init__()
        linear = quantization.QuantLinear(torch.nn.Linear(16, 8), "int8", {1: "int_mm"})
        self.packed = linear._fbgemm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x, self.packed, True)


def test_a_graph_that_fails_to_compile_is_an_error_when_fallbacks_are(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RINGSERVE_GRAPH_STORE", "0")
    compiler = BackgroundCompiler(_Uncompilable(), lambda bs: (torch.ones(bs, 16),), progress=False)
    compiler.request((1, 1))
    compiler.wait((1, 1), COMPILE_TIMEOUT)
    state = compiler.report()["bs 1, 1 thread"]
    assert state.startswith("failed: ") and len(state) > len("failed: ") + 20, state  # names the exception
    with pytest.raises(GraphFailed, match="forbids running it eagerly"):
        compiler.ready((1, 1))
    monkeypatch.setenv(FALLBACK_ENV, "eager")
    assert compiler.ready((1, 1)) == compiler.forward  # served eagerly, and still reported as failed
