"""Our float32 GEMV for few-row linears (kernels/cpu/f32_gemv.cpp, kernels/float_linear.py).

The kernel against torch's `F.linear` on odd shapes, row counts, thread counts and both ISA paths; bad inputs
refused; `GemvLinear` sharing its layer's Parameters, running ours only up to its row count and tracing into a
compiled graph; the per-host measurement and the swap; and the real SmolLM2 with the GEMV on every linear
giving transformers' greedy tokens, alone and batched."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kernels.cpu as cpu_kernels
from kernels.float_linear import GEMV_ROWS, GemvLinear, gemv_report, measure_gemv_rows, use_f32_gemv
from tests.test_kernels_cpu_qgemm import each_isa_path_and_thread_count

needs_build = pytest.mark.skipif(not cpu_kernels.compiled(), reason="the C++ kernels did not build here")
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


@needs_build
def test_a_gemv_linear_shares_its_parameters_and_runs_ours_up_to_its_rows_compiled_too() -> None:
    torch.manual_seed(1)
    linear = nn.Linear(40, 24)
    layer = GemvLinear(linear, gemv_rows=2)
    assert layer.weight is linear.weight and layer.bias is linear.bias
    three = torch.randn(3, 40)
    assert torch.equal(layer(three), F.linear(three, linear.weight, linear.bias))  # torch's own past its rows
    one = torch.randn(1, 1, 40)
    assert layer(one).shape == (1, 1, 24)
    torch.testing.assert_close(layer(one), linear(one), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        linear.weight.mul_(2)  # a weight update copying into the layer's Parameter reaches the GemvLinear
    torch.testing.assert_close(layer(one), linear(one), rtol=1e-5, atol=1e-5)

    traced: list[str] = []

    def backend(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Any:
        traced.extend(str(node.target) for node in gm.graph.nodes)
        return gm.forward

    compiled = torch.compile(layer, backend=backend, fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(one), linear(one), rtol=1e-5, atol=1e-5)
    assert any("ringserve_cpu.f32_linear" in target for target in traced), traced


@needs_build
def test_the_host_measures_each_shape_and_only_chosen_shapes_are_swapped(plan_dir: Path) -> None:
    chosen, measured = measure_gemv_rows([(24, 40), (40, 24)], rounds=1)
    assert set(chosen) == {(24, 40), (40, 24)} and set(chosen.values()) <= {0, *GEMV_ROWS}
    assert set(measured["times"]) == {f"{n},{k},{r}" for n, k in chosen for r in GEMV_ROWS}
    assert all(set(t) == {"float32", "f32_gemv"} for t in measured["times"].values()) and not measured["cached"]
    assert measure_gemv_rows([(24, 40), (40, 24)], rounds=1)[0] == chosen  # read back from the cache
    model = nn.Sequential(nn.Linear(40, 24), nn.ReLU(), nn.Linear(24, 40))
    assert use_f32_gemv(model, {(24, 40): 4, (40, 24): 0}) == 1
    assert isinstance(model[0], GemvLinear) and type(model[2]) is nn.Linear
    assert gemv_report(model) == {"40->24 1-4 rows": "f32_gemv"}


@needs_build
def test_smollm2_with_the_gemv_on_every_linear_gives_transformers_greedy_tokens(
        smollm_hf: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import actors.engine.quantize as quantize
    from actors.common.model_source import resolve_model
    from actors.engine.engine import Engine, EngineConfig
    from bus.messages import TokenizedRequest
    from tests.engine_helpers import assert_greedy_matches, greedy, hf_greedy, run_to_completion, tokens_of
    from tests.test_engine_smollm2 import MAX_NEW, PROMPTS

    monkeypatch.setattr(quantize, "measure_gemv_rows",  # this host's choice aside: every shape, up to 4 rows
                        lambda shapes: ({shape: 4 for shape in shapes}, {"cached": False}))
    engine = Engine.from_source(resolve_model("SmolLM2-135M-Instruct"), EngineConfig(device="cpu"))
    report = engine.stats().quantization
    assert report["method"] == "none" and report["576->49152 1-4 rows"] == "f32_gemv", report  # the tied head too
    assert engine.runner.model.lm_head.weight is engine.runner.model.model.embed_tokens.weight
    tokenizer, eos = engine.tokenizer, engine.tokenizer.eos_token_id
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for p in PROMPTS]
    expected = [hf_greedy(smollm_hf, p, MAX_NEW, eos) for p in prompts]

    def request(rid: str, i: int) -> TokenizedRequest:
        return TokenizedRequest(rid, prompts[i], greedy(MAX_NEW, stop_token_ids=[eos]))

    alone = run_to_completion(engine, [request("alone", 0)])  # decode steps of one row
    assert_greedy_matches(smollm_hf, prompts[0], expected[0], tokens_of(alone["alone"]))
    together = run_to_completion(engine, [request(f"t{i}", i) for i in range(len(PROMPTS))])  # of up to 4 rows
    for i in range(len(PROMPTS)):
        assert_greedy_matches(smollm_hf, prompts[i], expected[i], tokens_of(together[f"t{i}"]))
