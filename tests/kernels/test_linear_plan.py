"""The kernel-plan module's one door (kernels/linear_plan/planner.py): which kernels each shape is measured
among per `--quantization` method (int4's head among int8's, each GGUF shape among its block format's), auto
taking int8 only for a clear win, and the engine's start-up log of what it chose."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

import ringserve.kernels.cpu as cpu_kernels
import ringserve.kernels.linear_plan.planner as planner
from ringserve.actors.engine.config import EngineConfig
from ringserve.actors.engine.models.weights import model_from_hf
from ringserve.actors.engine.quantization.quantize import apply_quantization
from ringserve.kernels.cpu.packing import pack
from ringserve.kernels.linear_plan.candidates import candidates, float_plan_possible
from ringserve.kernels.linear_plan.planner import plan_linears
from tests.engine_helpers import tiny_hf_llama

cpu_kernels.compiled()  # built (or found built) now, in the usual cache, before `plan_dir` moves it
ROWS = {(32, 64): [1, 2, 4], (96, 64): [1, 2]}  # a projection and the LM head


class Tiny(nn.Module):
    """A projection and an LM head, as the planner sees a model: named `nn.Linear`s."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 32)
        self.lm_head = nn.Linear(64, 96, bias=False)


def test_int4_measures_the_heads_shape_among_int8s_kernels(plan_dir: Path) -> None:
    chosen = plan_linears(Tiny(), ROWS, "int4")
    assert chosen.method == "int4" and set(chosen.plan) == set(ROWS)
    assert [m.kind for m in chosen.passes] == ["int4"] and not chosen.auto_speedups
    times = chosen.passes[0].times
    assert set(times["32,64,1"]) == set(candidates("int4"))
    assert set(times["96,64,1"]) == set(candidates("int8"))
    assert set(chosen.plan[(96, 64)].values()) <= set(candidates("int8"))
    assert plan_linears(Tiny(), ROWS, "int4").passes[0].cached  # both groups read back


def test_gguf_measures_each_shape_among_its_block_format_and_refuses_mixed_ones(plan_dir: Path) -> None:
    packed = {"proj": pack(torch.randn(32, 64), "q4_0"), "lm_head": pack(torch.randn(96, 64), "q8_0")}
    chosen = plan_linears(Tiny(), ROWS, "gguf", packed)
    assert chosen.method == "gguf" and set(chosen.plan) == set(ROWS) and [m.kind for m in chosen.passes] == ["gguf"]
    assert set(chosen.passes[0].times["32,64,2"]) == set(candidates("q4_0"))
    assert set(chosen.passes[0].times["96,64,2"]) == set(candidates("q8_0"))
    mixed = {"proj": pack(torch.randn(32, 64), "q4_0"), "other": pack(torch.randn(32, 64), "q8_0")}
    with pytest.raises(ValueError, match="different block types"):
        plan_linears(Tiny(), ROWS, "gguf", mixed)


@pytest.mark.parametrize("threshold, method", [(0.0, "int8"), (float("inf"), "none")])
def test_auto_takes_int8_only_when_it_is_faster_by_the_threshold(
        threshold: float, method: str, plan_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(planner, "AUTO_MIN_SPEEDUP", threshold)
    chosen = plan_linears(Tiny(), ROWS, "auto")
    assert chosen.method == method and set(chosen.auto_speedups) == set(planner.AUTO_BATCHES)
    kinds = ["int8"] + (["float32"] if method == "none" and float_plan_possible() else [])
    assert [m.kind for m in chosen.passes] == kinds
    if method == "none":  # the plan the layers get is the float32 one
        assert all(set(p.values()) <= {"float32", "f32_gemv", "onednn"} for p in chosen.plan.values())
        assert chosen.plan == (chosen.passes[1].plan if len(kinds) > 1 else {})


def test_the_engine_logs_each_measuring_pass_and_autos_verdict(
        plan_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(planner, "AUTO_MIN_SPEEDUP", float("inf"))  # int8 loses: the float32 plan follows
    hf = tiny_hf_llama()
    model = model_from_hf(hf.config, hf.state_dict(), "cpu")
    with caplog.at_level(logging.INFO, logger="engine"):
        applied, _ = apply_quantization(model, EngineConfig(device="cpu", quantization="auto",
                                                            chunked_prefill_size=64))
    events = [r for r in caplog.records if r.name == "engine"]
    expected = ["int8 kernels per linear shape and step size", "quantization auto",
                *(["float32 kernels per linear shape and step size"] if float_plan_possible() else [])]
    assert applied == "none" and [r.getMessage() for r in events] == expected
    assert events[1].fields["chosen"] == "none" and set(events[1].fields) == {
        "chosen", "int8_speedup_batch1", "int8_speedup_batch16"}
    assert set(events[0].fields) == {"isa", "cached", "seconds", "choices"}
