"""Quantized linears (int8, int4): close to float32, swapped in from outside the model, each call running the
kernel the per-host plan measured fastest and never one slower than float32; the engine runs them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import ringserve.kernels.cpu as cpu_kernels
from ringserve.actors.engine.models.weights import model_from_hf
from ringserve.bus.messages import TokenizedRequest
from ringserve.kernels.float_linear import onednn_available
from ringserve.kernels.linear_plan.candidates import candidates, choose_kernel
from ringserve.kernels.linear_plan.measure import measure_quantized
from ringserve.kernels.linear_plan.plan import plan_buckets, plan_report
from ringserve.kernels.linear_plan.report import speedup
from ringserve.kernels.quantization import QuantLinear, quantize_linears
from tests.engine_helpers import engine_for, greedy, run_to_completion, tiny_hf_llama, tokens_of

COMPILED = cpu_kernels.compiled()  # built (or found built) now, in the usual cache, before any test moves it


@pytest.mark.parametrize("method, kernel, tolerance", [("int8", "q8_0", 0.02), ("int8", "int_mm", 0.02),
                                                       ("int4", "q4_1", 0.12)])
def test_quantized_linears_are_close_to_float(method: str, kernel: str, tolerance: float) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, bias=True)
    x = torch.randn(5, 3, 64)
    expected = linear(x)
    layer = QuantLinear(linear, method, {1: kernel})
    got = layer(x)
    assert got.shape == expected.shape and layer.kernel_for(15) == kernel
    assert (got - expected).norm() / expected.norm() < tolerance
    assert layer.weight_f is None  # without float32 in its plan no float copy is kept


@pytest.mark.parametrize("kernel", ["q8_0", "int_mm"])
def test_rows_do_not_depend_on_their_batch(kernel: str) -> None:
    """Activations are scaled per row (and block): a token with huge activations (an attention sink) in the
    same batch changes nothing for the others."""
    torch.manual_seed(1)
    quantized = QuantLinear(nn.Linear(64, 32, bias=False), "int8", {1: kernel})
    x = torch.randn(4, 64)
    alone = quantized(x)
    sink = torch.zeros(1, 64)
    sink[0, 3] = 500.0
    assert torch.equal(quantized(torch.cat([sink, x]))[1:], alone)
    # a single row (fbgemm's kernel for int_mm) is on the same grid up to rounding
    assert (quantized(x[2:3]) - alone[2:3]).norm() / alone[2:3].norm() < 0.02


def test_quantize_linears_replaces_every_projection_and_the_head() -> None:
    hf = tiny_hf_llama()
    model = model_from_hf(hf.config, hf.state_dict())
    quantize_linears(model, "int4")
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model.lm_head, QuantLinear) and model.lm_head.method == "int8"  # int4 keeps the head int8
    assert model.model.layers[0].mlp.down_proj.method == "int4"
    with pytest.raises(ValueError, match="int3"):
        quantize_linears(model, "int3")


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_the_engine_runs_quantized_weights_with_logits_close_to_float32(method: str) -> None:
    hf = tiny_hf_llama()
    prompt = [5, 17, 42, 99, 7]
    exact = engine_for(hf, device="cpu")
    quantized = engine_for(hf, device="cpu")
    quantize_linears(quantized.runner.model, method)
    params = greedy(8, return_logprob=True, top_logprobs_num=5)
    a = run_to_completion(exact, [TokenizedRequest("a", prompt, params)])["a"]
    b = run_to_completion(quantized, [TokenizedRequest("b", prompt, params)])["b"]
    assert len(tokens_of(b)) == 8
    # the first token's distribution (same context for both) barely moves (int4's a little more: the top one)
    top = 2 if method == "int8" else 1
    assert a[0].top_ids[0][:top] == b[0].top_ids[0][:top]
    assert a[0].top_logprobs[0][0] == pytest.approx(b[0].top_logprobs[0][0], abs=0.25 if method == "int8" else 0.5)


def test_a_plan_runs_float32_where_the_quantized_kernel_was_measured_slower() -> None:
    torch.manual_seed(3)
    linear = nn.Linear(64, 32)
    layer = QuantLinear(linear, "int8", {1: "q8_0", 2: "float32"})  # 1 row: q8_0; 2-3 rows and more: float32
    with torch.no_grad():
        for rows in (2, 3, 8):  # 8 rows: above the largest bucket, so it follows that bucket
            x = torch.randn(rows, 64)
            torch.testing.assert_close(layer(x), linear(x), rtol=0, atol=0)
        one = torch.randn(1, 64)
        assert not torch.equal(layer(one), linear(one))  # quantized there
        torch.testing.assert_close(layer(one), linear(one), rtol=0.05, atol=0.05)


@pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN")
def test_a_plan_runs_onednn_on_the_float32_weight_where_it_was_measured_fastest() -> None:
    torch.manual_seed(4)
    linear = nn.Linear(64, 32)
    layer = QuantLinear(linear, "int8", {1: "q8_0", 2: "onednn"})  # 2 rows and more: oneDNN on float32
    assert layer.weight_f is not None and layer.weight_f.data_ptr() == linear.weight.data_ptr()
    with torch.no_grad():
        x = torch.randn(5, 64)
        torch.testing.assert_close(layer(x), linear(x), rtol=1e-5, atol=1e-5)
        traced: list[str] = []

        def backend(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> object:
            traced.extend(str(node.target) for node in gm.graph.nodes)
            return gm.forward

        torch._dynamo.reset()
        compiled = torch.compile(layer, backend=backend, fullgraph=True, dynamic=False)
        torch.testing.assert_close(compiled(x), linear(x), rtol=1e-5, atol=1e-5)
    assert any("ringserve.onednn_linear" in target for target in traced), traced
    assert candidates("int8")[:2] == ("float32", "onednn")


def test_auto_weighs_the_plan_against_the_fastest_float32_kernel() -> None:
    times = {"8,8,1": {"float32": 2.0, "onednn": 1.0, "q8_0": 0.5}, "8,8,2": {"float32": 2.0, "q8_0": 1.0},
             "16,8,1": {"float32": 4.0, "onednn": 3.0, "q8_0": 3.5}}
    plan = {(8, 8): {1: "q8_0", 2: "q8_0"}, (16, 8): {1: "onednn"}}
    assert speedup(times, plan, 1) == pytest.approx((1.0 + 3.0) / (0.5 + 3.0))
    assert speedup(times, plan, 2) == pytest.approx(2.0)  # where oneDNN was not measured, torch's


def test_the_choice_is_never_slower_than_float32_and_prefers_quality_in_a_near_tie() -> None:
    order = ("float32", "q8_0", "int_mm")
    assert choose_kernel({"float32": 1.0, "q8_0": 1.2, "int_mm": 0.5}, order) == "int_mm"
    assert choose_kernel({"float32": 1.0, "q8_0": 0.97, "int_mm": 1.5}, order) == "float32"  # within the noise
    assert choose_kernel({"float32": 1.0, "q8_0": 0.5, "int_mm": 0.47}, order) == "q8_0"  # better, 6% slower
    assert choose_kernel({"float32": 1.0, "q8_0": 0.5, "int_mm": 0.2}, order) == "int_mm"
    assert plan_buckets({1: "q8_0", 2: "q8_0", 3: "float32", 4: "q8_0"}) == {
        "1-3 rows": "q8_0", "4-7 rows": "float32", "8+ rows": "q8_0"}
    assert plan_report({(960, 576): {1: "q4_1"}}) == {"576->960 1+ rows": "q4_1"}


def test_the_plan_is_measured_per_shape_and_row_count_then_cached(plan_dir: Path) -> None:
    shapes = {(32, 64): [1, 2, 4, 8], (48, 64): [1, 2]}
    measured = measure_quantized(shapes, "int8", rounds=1)
    plan = measured.plan
    assert set(plan) == set(shapes) and set(plan[(32, 64)]) == {1, 2, 3, 4} and set(plan[(48, 64)]) == {1, 2}
    assert {k for p in plan.values() for k in p.values()} <= set(measured.candidates)
    assert measured.candidates[0] == "float32" and ("q8_0" in measured.candidates) == COMPILED
    assert not measured.cached and list((plan_dir / "kernel_plans").glob("*.json"))
    again = measure_quantized(shapes, "int8", rounds=1)
    assert again.cached and again.plan == plan and again.times == measured.times
    for entry, times in measured.times.items():  # whatever was chosen measured no slower than float32
        n, k, rows = (int(v) for v in entry.split(","))
        assert times[plan[(n, k)][rows.bit_length()]] <= times["float32"]


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_apply_quantization_measures_its_kernels_and_reports_them(method: str, plan_dir: Path) -> None:
    from ringserve.actors.engine.config import EngineConfig
    from ringserve.actors.engine.quantization.quantize import apply_quantization, plan_rows, quantization_report

    hf = tiny_hf_llama()
    model = model_from_hf(hf.config, hf.state_dict(), "cpu")
    config = EngineConfig(device="cpu", quantization=method, chunked_prefill_size=128)
    rows = plan_rows(model, config)
    assert all(r == [1, 2, 4, 8, 16, 32, 64, 128] for shape, r in rows.items() if shape != (hf.config.vocab_size,
                                                                                          hf.config.hidden_size))
    applied, plan = apply_quantization(model, config)
    assert applied == method and set(plan) == set(rows)
    report = quantization_report(model)
    assert report["method"] == method and report["isa"] == cpu_kernels.isa()
    assert {k: v for k, v in report.items() if k not in ("method", "isa")} == plan_report(plan)
    assert any(" 1-" in key or " 1+" in key for key in report)
    if method == "int4":  # the head's shape was measured among int8's kernels
        assert set(model.lm_head.plan.values()) <= {"float32", "onednn", "q8_0", "int_mm"}
    assert quantization_report(model_from_hf(hf.config, hf.state_dict(), "cpu")) == {}
