"""Float32 linears by the kernel measured fastest per shape and row count (kernels/float_linear.py, measured and
chosen by kernels/linear_plan/): our GEMV (kernels/cpu/f32_gemv.cpp), oneDNN's matmul, torch's.

Our GEMV against torch's `F.linear` on odd shapes, row counts, thread counts and both ISA paths; bad inputs
refused; oneDNN's against torch's; `FloatLinear` sharing its layer's Parameters and running, eagerly and traced
into a compiled graph, the kernel its plan names for each row count; the per-host measurement, its choice
rule and the swap; and the real SmolLM2 with our GEMV and oneDNN on every linear giving transformers' greedy
tokens, alone and batched."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ringserve.kernels.cpu as cpu_kernels
from ringserve.kernels.float_linear import FLOAT_KERNELS, FloatLinear, onednn_available, onednn_linear, use_float_plan
from ringserve.kernels.linear_plan.candidates import GEMV_MAX_ROWS, choose_float_kernel
from ringserve.kernels.linear_plan.measure import measure_float
from ringserve.kernels.linear_plan.plan import Measured
from ringserve.kernels.linear_plan.report import float_report
from tests.kernels.test_kernels_cpu_qgemm import each_isa_path_and_thread_count

needs_build = pytest.mark.skipif(not cpu_kernels.compiled(), reason="the C++ kernels did not build here")
needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN")
# (out N, in K): K below, at and past a vector (8 or 16 lanes) with tails, N not a multiple of the 4-row block
SHAPES = [(1, 1), (3, 7), (5, 16), (7, 17), (9, 33), (64, 576), (130, 1000)]
ROWS = [1, 2, 3, 4, 5, 9]


@needs_build
def test_the_kernel_matches_torch_on_every_isa_path_shape_row_count_and_thread_count() -> None:
    torch.manual_seed(0)
    op = cpu_kernels.f32_linear()
    for path, threads in each_isa_path_and_thread_count():
        for n, k in SHAPES:
            weight, bias = torch.randn(n, k), torch.randn(n)
            for rows in ROWS:
                x = torch.randn(rows, k)
                b = bias if rows % 2 else None
                # the same products, summed in another order
                torch.testing.assert_close(op(x, weight, b), F.linear(x, weight, b), rtol=1e-5, atol=1e-5 * k ** 0.5,
                                           msg=f"{path} threads={threads} N={n} K={k} rows={rows}")


@needs_build
def test_inputs_the_kernel_cannot_read_are_refused() -> None:
    op, x, weight = cpu_kernels.f32_linear(), torch.randn(1, 8), torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="contiguous"):
        op(x, torch.randn(8, 4).t(), None)
    with pytest.raises(RuntimeError, match="float32"):
        op(x.double(), weight.double(), None)
    with pytest.raises(RuntimeError, match=r"\[M, K\]"):
        op(torch.randn(1, 7), weight, None)
    with pytest.raises(RuntimeError, match="bias"):
        op(x, weight, torch.randn(3))


@needs_onednn
def test_onednn_matches_torch_on_odd_shapes_row_counts_and_layouts() -> None:
    torch.manual_seed(2)
    for n, k in SHAPES:
        weight, bias = torch.randn(n, k), torch.randn(n)
        for rows in (1, 3, 4, 33, 130):
            x = torch.randn(rows, k)
            torch.testing.assert_close(onednn_linear(x, weight, bias if rows % 2 else None),
                                       F.linear(x, weight, bias if rows % 2 else None), rtol=1e-5, atol=1e-5 * k ** 0.5)
    x = torch.randn(2, 3, 80)[..., ::2]  # batched and strided, as a layer may be called
    weight = torch.randn(12, 40)
    torch.testing.assert_close(onednn_linear(x, weight, None), F.linear(x, weight), rtol=1e-5, atol=1e-4)


def _traced_targets(layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[str]]:
    """`layer(x)` compiled whole, and the ops its graph called."""
    traced: list[str] = []

    def backend(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Any:
        traced.extend(str(node.target) for node in gm.graph.nodes)
        return gm.forward

    torch._dynamo.reset()
    return torch.compile(layer, backend=backend, fullgraph=True, dynamic=False)(x), traced


@needs_build
@needs_onednn
def test_a_float_linear_shares_its_parameters_and_runs_its_plans_kernel_per_row_count_compiled_too() -> None:
    torch.manual_seed(1)
    linear = nn.Linear(40, 24)
    layer = FloatLinear(linear, {1: "f32_gemv", 2: "float32", 3: "onednn"})  # 1 row, 2-3 rows, 4+ rows
    assert layer.weight is linear.weight and layer.bias is linear.bias
    three = torch.randn(3, 40)
    assert torch.equal(layer(three), F.linear(three, linear.weight, linear.bias))  # torch's own at 2-3 rows
    one, many = torch.randn(1, 1, 40), torch.randn(2, 5, 40)
    assert layer(one).shape == (1, 1, 24) and layer(many).shape == (2, 5, 24)
    for x in (one, many):
        torch.testing.assert_close(layer(x), linear(x), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        linear.weight.mul_(2)  # a weight update copying into the layer's Parameter reaches the FloatLinear
    for x in (one, many):
        torch.testing.assert_close(layer(x), linear(x), rtol=1e-5, atol=1e-5)
    for x, op in ((one, "ringserve_cpu.f32_linear"), (many, "ringserve.onednn_linear"), (three, "linear")):
        y, traced = _traced_targets(layer, x)
        torch.testing.assert_close(y, linear(x), rtol=1e-5, atol=1e-5)
        assert any(op in target for target in traced), (x.shape, traced)
    with pytest.raises(ValueError, match="unknown float32 kernels"):
        FloatLinear(linear, {1: "q8_0"})


def test_another_kernel_than_torchs_is_chosen_only_when_faster_by_the_margin() -> None:
    assert choose_float_kernel({"float32": 1.0, "f32_gemv": 0.5, "onednn": 0.7}) == "f32_gemv"
    assert choose_float_kernel({"float32": 1.0, "onednn": 0.9}) == "onednn"
    assert choose_float_kernel({"float32": 1.0, "onednn": 0.97}) == "float32"  # within the noise
    assert choose_float_kernel({"float32": 1.0}) == "float32"


@needs_build
@needs_onednn
def test_the_host_measures_each_shape_and_row_count_and_only_shapes_it_helps_are_swapped(plan_dir: Path) -> None:
    shapes = {(24, 40): [1, 2, 4, 8], (40, 24): [1, 4]}
    measured = measure_float(shapes, rounds=1)
    plan = measured.plan
    assert plan.keys() == shapes.keys() and set(plan[(24, 40)]) == {1, 2, 3, 4} and set(plan[(40, 24)]) == {1, 3}
    assert {f"{n},{k},{r}" for (n, k), rows in shapes.items() for r in rows} == set(measured.times)
    for entry, times in measured.times.items():
        rows = int(entry.split(",")[2])
        assert set(times) == {"float32", "onednn", *(["f32_gemv"] if rows <= GEMV_MAX_ROWS else [])}, entry
    assert all(set(p.values()) <= set(FLOAT_KERNELS) for p in plan.values()) and not measured.cached
    again = measure_float(shapes, rounds=1)  # read back from the cache
    assert again.plan == plan and again.cached
    model = nn.Sequential(nn.Linear(40, 24), nn.ReLU(), nn.Linear(24, 40))
    assert use_float_plan(model, {(24, 40): {1: "f32_gemv", 2: "f32_gemv", 3: "onednn"}, (40, 24): {1: "float32"}}) == 1
    assert isinstance(model[0], FloatLinear) and type(model[2]) is nn.Linear
    assert float_report(model) == {"40->24 1-3 rows": "f32_gemv", "40->24 4+ rows": "onednn"}


@needs_build
@needs_onednn
def test_smollm2_with_our_gemv_and_onednn_on_every_linear_gives_transformers_greedy_tokens(
        smollm_hf: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import ringserve.kernels.linear_plan.planner as planner
    from ringserve.actors.common.model_source import resolve_model
    from ringserve.actors.engine.scheduling.engine_core import EngineCore, EngineConfig
    from ringserve.bus.messages import TokenizedRequest
    from tests.engine_helpers import assert_greedy_matches, greedy, hf_greedy, run_to_completion, tokens_of
    from tests.models.test_engine_smollm2 import MAX_NEW, PROMPTS

    forced = {1: "f32_gemv", 2: "f32_gemv", **{bits: "onednn" for bits in range(3, 12)}}  # prefill: oneDNN
    monkeypatch.setattr(planner, "measure_float",  # this host's choice aside
                        lambda shape_rows: Measured("float32", {shape: forced for shape in shape_rows}, {}, False))
    engine = EngineCore.from_source(resolve_model("SmolLM2-135M-Instruct"), EngineConfig(device="cpu"))
    report = engine.stats().quantization
    assert report["method"] == "none" and report["576->49152 1-3 rows"] == "f32_gemv", report  # the tied head too
    assert report["576->49152 4+ rows"] == "onednn", report
    assert engine.runner.model.lm_head.weight is engine.runner.model.model.embed_tokens.weight
    tokenizer, eos = engine.tokenizer, engine.tokenizer.eos_token_id
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for p in PROMPTS]
    expected = [hf_greedy(smollm_hf, p, MAX_NEW, eos) for p in prompts]

    def request(rid: str, i: int) -> TokenizedRequest:
        return TokenizedRequest(rid, prompts[i], greedy(MAX_NEW, stop_token_ids=[eos]))

    alone = run_to_completion(engine, [request("alone", 0)])  # decode steps of one row
    assert_greedy_matches(smollm_hf, prompts[0], expected[0], tokens_of(alone["alone"]))
    together = run_to_completion(engine, [request(f"t{i}", i) for i in range(len(PROMPTS))])  # 4 rows: oneDNN
    for i in range(len(PROMPTS)):
        assert_greedy_matches(smollm_hf, prompts[i], expected[i], tokens_of(together[f"t{i}"]))
