"""bfloat16 compute for a bfloat16 checkpoint on a CPU (kernels/float_linear.py's `bf16` kernel, measured and
chosen by kernels/linear_plan/, allowed by actors/engine/quantization/quantize.py's `bf16_allowed`).

The kernel against `F.linear` of bfloat16-rounded inputs and weights, eagerly and traced into a compiled
graph; its choice rule; a bfloat16 checkpoint's plan measuring it (a float32 checkpoint's never, nor with
`--float-kernels float32` or a quantization); and, the plan forced to it on every linear, a tiny Qwen3's
logits within bfloat16 tolerance of transformers running the same checkpoint in bfloat16, its greedy tokens
transformers'-bfloat16, and a weight update reaching the bfloat16 weights and copies."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ringserve.kernels.linear_plan.planner as planner
from ringserve.actors.common.model_source import resolve_model
from ringserve.actors.engine.config import EngineConfig
from ringserve.actors.engine.models.weights import checkpoint_dtype, load_checkpoint, load_model, swap_weights
from ringserve.actors.engine.quantization.quantize import apply_quantization, bf16_allowed
from ringserve.actors.engine.scheduling.engine_core import EngineCore
from ringserve.bus.messages import TokenizedRequest
from ringserve.kernels.float_linear import (BF16, FloatLinear, bf16_available, bf16_linear, float_linears,
                                            onednn_available)
from ringserve.kernels.linear_plan.candidates import choose_float_kernel
from ringserve.kernels.linear_plan.plan import Measured
from tests.engine_helpers import assert_greedy_matches, greedy, hf_greedy, run_to_completion, tokens_of
from tests.model_families import tiny_hf_model
from tests.models.test_engine_model import PagedRunner

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN")
# oneDNN's bfloat16 matmul needs AVX-512 or AMX; an AVX2-only host (AMD Zen 3) measures and runs float32 kernels
# instead, which test_a_bf16_checkpoint_measures_the_bf16_kernel_where_this_cpu_runs_it checks there
needs_bf16 = pytest.mark.skipif(not bf16_available(), reason="oneDNN has no bfloat16 matmul on this CPU")
ALL_BF16 = {bits: "bf16" for bits in range(1, 12)}  # every row-count bucket up to 1024+ rows
CONFIG = dict(device="cpu", torch_threads=1, max_total_tokens=16384, chunked_prefill_size=64)
# Logits differ from transformers' bfloat16 ones by bfloat16 rounding through 3 layers (ours keep the residual
# stream and norms in float32): measured up to 0.25 of logits up to 9 on this model; float32 differs by 1e-2.
LOGIT_TOL = 0.05  # of the largest logit
TIE_TOL = 0.25  # a greedy token may differ only where transformers' bfloat16 top-2 are this close


def _save(directory: Path, dtype: torch.dtype, seed: int = 0) -> Path:
    tiny_hf_model("qwen3", seed).to(dtype).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 (tied LM head) saved in bfloat16."""
    return _save(tmp_path_factory.mktemp("qwen3-bf16"), torch.bfloat16)


@pytest.fixture(scope="module")
def f32_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same model saved in float32."""
    return _save(tmp_path_factory.mktemp("qwen3-f32"), torch.float32)


@needs_bf16
def test_the_kernel_is_f_linear_of_bf16_rounded_inputs_and_weights_eager_and_compiled() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(72, 40)
    with torch.no_grad():  # a bfloat16 checkpoint's layer: its float32 weights are bfloat16 values
        linear.weight.copy_(linear.weight.to(BF16))
        linear.bias.copy_(linear.bias.to(BF16))
    only = FloatLinear(linear, {1: "bf16", 2: "bf16"})  # runs nothing else: keeps only bfloat16 weights
    mixed = FloatLinear(linear, {1: "bf16", 2: "float32"})  # 1 row bf16, 2+ rows float32: keeps both
    assert only.weight.dtype == BF16 and only.weight_bf16 is None and torch.equal(only.weight.float(), linear.weight)
    assert mixed.weight is linear.weight and mixed.weight_bf16.dtype == BF16
    for x in (torch.randn(1, 72), torch.randn(3, 5, 72), torch.randn(300, 72)):
        expected = F.linear(x.to(BF16), linear.weight.to(BF16), linear.bias.to(BF16)).float()
        with torch.no_grad():
            got = only(x)
        assert got.dtype == torch.float32 and got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)  # bfloat16 output rounding at most
        assert (got - F.linear(x, linear.weight, linear.bias)).abs().max() > 1e-4  # not float32's result
    one, four = torch.randn(1, 72), torch.randn(4, 72)
    with torch.no_grad():
        assert torch.equal(mixed(one), bf16_linear(one, linear.weight.to(BF16), linear.bias.to(BF16)))
        assert torch.equal(mixed(four), F.linear(four, linear.weight, linear.bias))
    traced: list[str] = []

    def backend(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Any:
        traced.extend(str(node.target) for node in gm.graph.nodes)
        return gm.forward

    torch._dynamo.reset()
    x = torch.randn(2, 72)
    with torch.no_grad():
        y = torch.compile(only, backend=backend, fullgraph=True, dynamic=False)(x)
        torch.testing.assert_close(y, only(x), rtol=0, atol=0)
    assert any("ringserve.bf16_linear" in target for target in traced), traced


def test_bf16_is_chosen_only_when_faster_than_torchs_by_the_margin_and_the_float32_kernels_by_the_near_tie() -> None:
    assert choose_float_kernel({"float32": 1.0, "onednn": 0.8, "bf16": 0.5}) == "bf16"
    assert choose_float_kernel({"float32": 1.0, "onednn": 0.8, "bf16": 0.75}) == "onednn"  # within 10%: float32
    assert choose_float_kernel({"float32": 1.0, "bf16": 0.97}) == "float32"  # within the noise of torch's
    assert choose_float_kernel({"float32": 1.0, "f32_gemv": 0.5, "bf16": 0.6}) == "f32_gemv"


def test_the_checkpoint_dtype_is_read_from_the_safetensors_headers(bf16_dir: Path, f32_dir: Path) -> None:
    assert checkpoint_dtype(resolve_model(str(bf16_dir))) == torch.bfloat16
    assert checkpoint_dtype(resolve_model(str(f32_dir))) == torch.float32
    bf16, f32 = resolve_model(str(bf16_dir)), resolve_model(str(f32_dir))
    assert bf16_allowed(EngineConfig(device="cpu"), bf16)
    assert bf16_allowed(EngineConfig(device="cpu", quantization="auto"), bf16)  # when auto stays unquantized
    assert not bf16_allowed(EngineConfig(device="cpu"), f32)
    assert not bf16_allowed(EngineConfig(device="cpu", float_kernels="float32"), bf16)  # the opt-out
    for method in ("int8", "int4"):
        assert not bf16_allowed(EngineConfig(device="cpu", quantization=method), bf16)
    assert not bf16_allowed(EngineConfig(device="cpu"), None)  # the source unknown (tensor parallel ranks)


def _float_pass(model_dir: Path, caplog: pytest.LogCaptureFixture, **config: Any) -> tuple[logging.LogRecord, nn.Module]:
    """Load `model_dir` in float32 and apply the engine's plan; the float32 measuring pass's log event."""
    source = resolve_model(str(model_dir))
    model = load_model(source, torch.float32, "cpu")
    with caplog.at_level(logging.INFO, logger="engine"):
        apply_quantization(model, EngineConfig(**{**CONFIG, **config}), source)
    events = [r for r in caplog.records if r.getMessage() == "float32 kernels per linear shape and step size"]
    caplog.clear()
    assert len(events) == 1
    return events[0], model


@needs_onednn
def test_a_bf16_checkpoint_measures_the_bf16_kernel_where_this_cpu_runs_it_a_float32_one_or_the_opt_out_never(
        bf16_dir: Path, f32_dir: Path, plan_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    event, model = _float_pass(bf16_dir, caplog)
    assert ("bf16" in event.fields["candidates"].split(", ")) == bf16_available(), event.fields
    for layer in model.modules():  # whatever this host chose, the layers run it
        if isinstance(layer, FloatLinear) and "bf16" in layer.plan.values():
            assert layer.weight.dtype == BF16 or layer.weight_bf16 is not None
    for model_dir, config in ((f32_dir, {}), (bf16_dir, {"float_kernels": "float32"})):
        event, model = _float_pass(model_dir, caplog, **config)
        assert "bf16" not in event.fields["candidates"], (model_dir, config)
        assert all(p.dtype == torch.float32 for p in model.parameters())


def _forced_bf16_engine(source: Any, monkeypatch: pytest.MonkeyPatch) -> EngineCore:
    """An engine for `source` whose plan runs `bf16` on every linear at every row count (where allowed)."""
    monkeypatch.setattr(planner, "measure_float", lambda shape_rows, bf16=False: Measured(
        "float32", {shape: ALL_BF16 if bf16 else {} for shape in shape_rows}, {}, False))
    model = load_model(source, torch.float32, "cpu")
    config = EngineConfig(**CONFIG)
    apply_quantization(model, config, source)
    return EngineCore(model, config, None)


def _assert_logits_match(model: nn.Module, hf: Any, seqs: list[list[int]]) -> None:
    """Our logits for `seqs` fed as a prefill of 2 tokens, an extend and a decode step equal `hf`'s within
    bfloat16 tolerance."""
    runner = PagedRunner(model, len(seqs))
    done = [0] * len(seqs)
    with torch.no_grad():
        for chunks in ([s[:2] for s in seqs], [s[2:-1] for s in seqs], [s[-1:] for s in seqs]):
            logits = runner.feed(chunks)
            for b, chunk in enumerate(chunks):
                done[b] += len(chunk)
                expected = hf(torch.tensor([seqs[b][:done[b]]])).logits[0, -1].float()
                tol = LOGIT_TOL * float(expected.abs().max())
                torch.testing.assert_close(logits[b], expected, rtol=0, atol=tol,
                                           msg=lambda m: f"sequence {b} at {done[b]} tokens: {m}")


@needs_bf16
def test_forced_to_bf16_a_tiny_qwen3_gives_transformers_bf16_logits_and_greedy_tokens_and_takes_weight_updates(
        bf16_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _forced_bf16_engine(resolve_model(str(bf16_dir)), monkeypatch)
    model = engine.runner.model
    report = engine.stats().quantization
    assert report["method"] == "none" and "bf16" in report.values(), report
    assert report["64->256 1+ rows"] == "bf16", report  # the tied LM head
    assert not float_linears(model)  # every linear follows the plan
    projections = [m for m in model.modules() if isinstance(m, FloatLinear) and m is not model.lm_head]
    assert projections and all(m.weight.dtype == BF16 and m.weight_bf16 is None for m in projections)
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.lm_head.weight_bf16.dtype == BF16
    hf = tiny_hf_model("qwen3").to(torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (4, 7, 12)]
    _assert_logits_match(model, hf, seqs)
    prompts = seqs[:2]
    eos = hf.config.eos_token_id
    rows = run_to_completion(engine, [TokenizedRequest(f"r{i}", p, greedy(6, stop_token_ids=[eos]))
                                      for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        assert_greedy_matches(hf, prompt, hf_greedy(hf, prompt, 6, eos), tokens_of(rows[f"r{i}"]), tol=TIE_TOL)
    # A weight update copies into the bfloat16 weights and refreshes the tied head's bfloat16 copy.
    other = _save(tmp_path / "other", torch.bfloat16, seed=1)
    swap_weights(model, load_checkpoint(str(other), torch.float32))
    _assert_logits_match(model, tiny_hf_model("qwen3", 1).to(torch.bfloat16), seqs)
