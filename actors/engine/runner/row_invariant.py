"""`--enable-deterministic-inference` in the runner: the step's paths that would compute a row differently with
other rows beside it are row-invariant ones, or off.

All of it is the execution plan's (actors/engine/execution_plan.py `row_invariant`); the linears' row-invariant
kernels are the linear plan's (actors/engine/quantization/quantize.py with kernels/linear_plan/invariant.py):
- attention: every query row (a prefill's, a verify step's, a decode's) runs the paged decode kernel
  (kernels/attention/torch_paged.py `row_invariant`), where a padded SDPA would block its sums by the step's
  shape and the decode kernel would run only the single-query rows; the runner switches its backend to it here;
- the fused C++ decode layer (kernels/cpu/decode_layer.cpp) is off (the plan's `fused_cpu_decode`): it runs
  decode-only steps with its own norm, rotary and activation arithmetic, so a verify or mixed step (the layer's
  torch modules) gave other bits;
- compiled decode graphs are off (EngineConfig.graph_max_bs): Inductor's fused norms sum in another order than
  the eager steps beside them.
"""

from __future__ import annotations

from ringserve.kernels.attention import AttentionBackend
from ringserve.kernels.attention.torch_paged import TorchPagedBackend


def use_row_invariant_attention(backend: AttentionBackend, graphs: bool) -> None:
    """Run every query row of `backend` through the paged decode kernel; ValueError where it has none (not the
    CPU paged decode kernel: another device or KV dtype, or our CPU kernels not built) or decode `graphs` run."""
    if not isinstance(backend, TorchPagedBackend) or not backend.in_place_decode:
        raise ValueError("--enable-deterministic-inference needs the CPU's paged attention kernel (a CPU, float32 KV "
                         "and our CPU kernels built)")
    if graphs:
        raise ValueError("--enable-deterministic-inference runs no compiled decode graphs (EngineConfig.graph_max_bs)")
    backend.row_invariant = True
