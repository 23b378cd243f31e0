"""Every execution choice of an engine, resolved once from its settings before the model is built.

`resolve_execution` is the one owner of these choices (the linear kernels are the linear plan's,
kernels/linear_plan/): which attention backend runs, whether norms and rotary run the fused Triton kernels, whether
a decode step may run each decoder layer as one C++ op, how a mixture-of-experts block runs its experts, how
decode batches run (CUDA graphs, compiled graphs, eagerly) and whether attention runs row-invariant. The model is
built with the plan (`models/causal_lm.build_model`), the runner runs it, and `/get_server_info` reports it
(`execution`); nothing changes a built model's modules or flags afterwards.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import ringserve.kernels.cpu as cpu_kernels
from ringserve.actors.engine.config import EngineConfig

NormRotaryKernels = Literal["torch", "triton"]
MoePath = Literal["grouped", "sorted"]
GraphMode = Literal["cuda_graph", "compile", "eager", "off"]


@dataclass(frozen=True)
class ExecutionPlan:
    """What an engine runs, beside the linear plan.

    - `attention_backend`: the registered attention backend (kernels/attention/).
    - `norm_rotary_kernels`: `triton` builds RMSNorms (not Gemma's `1 + weight` ones) as `TritonRMSNorm` and gives
      full-head rotary the Triton kernel; `torch` keeps the modules' own math.
    - `fused_cpu_decode`: whether a decoder layer (a fusable one) may run a decode step as one C++ op
      (kernels/cpu/decode_layer.py); it runs where quantization gave the layer packed linears.
    - `moe_path`: `grouped` (two grouped GEMMs over the stacked experts, kernels/triton/moe_gemm.py) or `sorted`
      (rows sorted by expert, each chosen expert run once on its rows).
    - `graph_mode`: how decode batches of up to `graph_max_bs` rows run (runner/graphs/decode_graph.py): CUDA
      graphs, compiled graphs, the padded graph forward run eagerly (tests), or `off` (every step eagerly).
    - `row_invariant`: every query row attends through the paged decode kernel
      (`--enable-deterministic-inference`, runner/row_invariant.py).
    """

    attention_backend: str = "torch"
    norm_rotary_kernels: NormRotaryKernels = "torch"
    fused_cpu_decode: bool = False
    moe_path: MoePath = "sorted"
    graph_mode: GraphMode = "off"
    graph_max_bs: int = 0
    row_invariant: bool = False

    def with_graphs(self, mode: GraphMode, max_bs: int) -> ExecutionPlan:
        """This plan with decode batches of up to `max_bs` rows run in `mode` (`off` where `max_bs` is 0)."""
        return dataclasses.replace(self, graph_mode=mode if max_bs > 0 else "off", graph_max_bs=max_bs)

    def running(self, built: ExecutionPlan) -> ExecutionPlan:
        """This plan over a model built with `built` (`CausalLM.execution`): the model's norm and rotary kernels,
        experts' path and fused decode layers are what run; ValueError where the model may run the fused decode op
        this plan rules out (LoRA, deterministic inference, another backend)."""
        if built.fused_cpu_decode and not self.fused_cpu_decode:
            raise ValueError("the model was built to run decode layers as one CPU op, which this engine's execution "
                             "plan rules out: build it with the engine's plan (resolve_execution)")
        return dataclasses.replace(self, norm_rotary_kernels=built.norm_rotary_kernels, moe_path=built.moe_path,
                                   fused_cpu_decode=built.fused_cpu_decode)

    def report(self, fused_layers: int) -> dict[str, str]:
        """The plan as `/get_server_info` shows it (`SchedulerInfo.execution`); `fused_layers`: the decoder layers
        that run decode steps as one C++ op (those quantization gave packed linears)."""
        fields = {name: str(value).lower() if isinstance(value, bool) else str(value)
                  for name, value in dataclasses.asdict(self).items()}
        fields["fused_cpu_decode"] = str(self.fused_cpu_decode and fused_layers > 0).lower()
        fields["fused_cpu_decode_layers"] = str(fused_layers)
        return fields


def resolve_execution(config: EngineConfig) -> ExecutionPlan:
    """The execution plan `config` asks for on its resolved device and dtype. Decode graphs are CUDA graphs on a
    GPU and compiled graphs on a CPU, where only a backend that reads the pool in place (the torch backend over a
    float32 pool with our CPU kernels built) makes them pay; the fused decode layer needs that backend too, a
    quantization that packs linears, and neither LoRA (the op knows no adapters) nor deterministic inference (its
    own arithmetic would give a decode step other bits than a mixed one)."""
    device = config.resolved_device()
    on_cuda = device.startswith("cuda")
    backend = config.resolved_attention_backend()
    in_place_decode = (backend == "torch" and device == "cpu" and config.resolved_dtype() == "float32"
                       and cpu_kernels.compiled())
    deterministic = config.enable_deterministic_inference
    fused = (in_place_decode and config.quantization != "none" and not config.lora_enabled()
             and not deterministic)
    max_bs = config.graph_max_bs()
    mode: GraphMode = "cuda_graph" if on_cuda else "compile"
    if mode == "compile" and not in_place_decode:
        max_bs = 0  # a CPU decode graph over a gathering attention path would be slower than eager at any length
    return ExecutionPlan(
        attention_backend=backend,
        norm_rotary_kernels="triton" if backend == "triton" and on_cuda else "torch",
        fused_cpu_decode=fused,
        moe_path="grouped" if on_cuda else "sorted",
        row_invariant=deterministic,
    ).with_graphs(mode, max_bs)


def plain_execution(device: str) -> ExecutionPlan:
    """What a model built outside an engine runs on `device` (`cpu`, `cuda`, ...): the torch kernels, no fused
    decode layer, no decode graphs; its experts as an engine on that device runs them."""
    return resolve_execution(EngineConfig(device=device, attention_backend="torch", disable_cuda_graph=True))
