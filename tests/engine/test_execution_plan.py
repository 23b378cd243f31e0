"""The execution plan (actors/engine/execution_plan.py): what `resolve_execution` chooses from the settings, that
the model is built with it (nothing swapped or flagged afterwards) and that `/get_server_info`'s `execution`
(the engine's `SchedulerInfo.execution`) reports what ran."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import ringserve.kernels.cpu as cpu_kernels
from ringserve.actors.engine.config import EngineConfig
from ringserve.actors.engine.execution_plan import ExecutionPlan, plain_execution, resolve_execution
from ringserve.actors.engine.models.blocks import RMSNorm
from ringserve.actors.engine.models.rope import apply_rotary
from ringserve.actors.engine.models.weights import model_from_hf
from ringserve.actors.engine.quantization.quantize import apply_quantization
from ringserve.actors.engine.scheduling.engine_core import EngineCore
from tests.engine_helpers import engine_for, tiny_hf_llama

needs_build = pytest.mark.skipif(not cpu_kernels.compiled(), reason="the C++ kernels did not build here")


@pytest.fixture(scope="module")
def hf() -> Any:
    return tiny_hf_llama()


def test_a_cpu_engine_runs_the_torch_kernels_and_its_experts_sorted() -> None:
    plan = resolve_execution(EngineConfig(device="cpu"))
    assert (plan.attention_backend, plan.norm_rotary_kernels, plan.moe_path) == ("torch", "torch", "sorted")
    assert not plan.fused_cpu_decode and not plan.row_invariant  # unquantized: no packed linears to fuse
    assert plan.graph_mode == ("compile" if cpu_kernels.compiled() else "off")


def test_a_gpu_engine_captures_cuda_graphs_and_groups_its_experts() -> None:
    plan = resolve_execution(EngineConfig(device="cuda", attention_backend="triton", cuda_graph_max_bs=8))
    assert (plan.norm_rotary_kernels, plan.moe_path, plan.graph_mode, plan.graph_max_bs) == (
        "triton", "grouped", "cuda_graph", 8)
    assert not plan.fused_cpu_decode
    torch_backend = resolve_execution(EngineConfig(device="cuda", attention_backend="torch"))
    assert torch_backend.norm_rotary_kernels == "torch"  # the Triton norms come with the Triton backend only


def test_disabled_graphs_lora_and_deterministic_inference_are_resolved_once() -> None:
    assert resolve_execution(EngineConfig(device="cpu", disable_cuda_graph=True)).graph_mode == "off"
    assert not resolve_execution(EngineConfig(device="cpu", quantization="int8", enable_lora=True)).fused_cpu_decode
    deterministic = resolve_execution(EngineConfig(device="cpu", quantization="int8",
                                                   enable_deterministic_inference=True))
    assert deterministic.row_invariant and not deterministic.fused_cpu_decode
    assert (deterministic.graph_mode, deterministic.graph_max_bs) == ("off", 0)
    fused = resolve_execution(EngineConfig(device="cpu", quantization="int8")).fused_cpu_decode
    assert fused == cpu_kernels.compiled()


def test_the_model_is_built_with_the_plans_kernels(hf: Any) -> None:
    """The Triton plan's norms and rotary are the model's modules from the start; the torch plan's are ours."""
    pytest.importorskip("triton")
    plain = model_from_hf(hf.config, hf.state_dict(), "cpu")
    assert plain.execution == plain_execution("cpu")
    assert isinstance(plain.model.norm, RMSNorm) and plain.model.layers[0].self_attn.rotary is apply_rotary
    triton = model_from_hf(hf.config, hf.state_dict(), "cpu", ExecutionPlan(norm_rotary_kernels="triton"))
    assert not any(isinstance(m, RMSNorm) for m in triton.modules())
    assert all(layer.self_attn.rotary is not apply_rotary for layer in triton.decoder_layers())


def test_the_report_says_what_runs(hf: Any) -> None:
    engine = engine_for(hf, disable_cuda_graph=True)
    report = engine.stats().execution
    assert report == {"attention_backend": "torch", "norm_rotary_kernels": "torch", "fused_cpu_decode": "false",
                      "fused_cpu_decode_layers": "0", "moe_path": "sorted", "graph_mode": "off", "graph_max_bs": "0",
                      "row_invariant": "false"}
    assert engine.stats().decode_graphs == {"mode": "off"}


@needs_build
def test_quantized_layers_run_the_fused_decode_op_unless_lora_is_on(hf: Any) -> None:
    """int8 linears are packed: every layer runs decode steps as one op, and the report says so; with LoRA the
    plan keeps the op off in every layer from the start (it knows no adapters)."""
    for lora in (False, True):
        config = EngineConfig(device="cpu", torch_threads=1, max_total_tokens=1024, quantization="int8",
                              disable_cuda_graph=True, enable_lora=lora)
        plan = resolve_execution(config)
        model = model_from_hf(hf.config, {k: v.clone() for k, v in hf.state_dict().items()}, "cpu", plan)
        assert apply_quantization(model, config)[0] == "int8"
        report = EngineCore(model, config, execution=plan).stats().execution
        layers = 0 if lora else hf.config.num_hidden_layers
        assert (report["fused_cpu_decode"], report["fused_cpu_decode_layers"]) == (str(not lora).lower(), str(layers))
        assert [layer.fused_decode for layer in model.decoder_layers()] == [not lora] * hf.config.num_hidden_layers


@needs_build
def test_a_model_built_to_fuse_is_refused_by_an_engine_that_rules_it_out(hf: Any) -> None:
    fused = resolve_execution(EngineConfig(device="cpu", quantization="int8"))
    model = model_from_hf(hf.config, hf.state_dict(), "cpu", fused)
    with pytest.raises(ValueError, match="decode layers as one CPU op"):
        EngineCore(model, EngineConfig(device="cpu", max_total_tokens=1024, quantization="int8", enable_lora=True))


def test_deterministic_inference_reports_row_invariant_attention(hf: Any) -> None:
    if not cpu_kernels.compiled():
        pytest.skip("the C++ kernels did not build here")
    report = engine_for(hf, enable_deterministic_inference=True).stats().execution
    assert (report["row_invariant"], report["graph_mode"], report["fused_cpu_decode"]) == ("true", "off", "false")
    assert torch.get_num_threads() >= 1
