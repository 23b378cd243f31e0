"""`--enable-deterministic-inference` in the runner: the step's paths that would compute a row differently with
other rows beside it are switched to row-invariant ones or off.

The linears' row-invariant kernels are chosen before (actors/engine/quantization/quantize.py with
kernels/linear_plan/invariant.py); here, on the model the runner holds:
- attention: every query row (a prefill's, a verify step's, a decode's) runs the paged decode kernel
  (kernels/attention/torch_paged.py `row_invariant`), where a padded SDPA would block its sums by the step's
  shape and the decode kernel would run only the single-query rows;
- the fused C++ decode layer (kernels/cpu/decode_layer.cpp) is off: it runs decode-only steps with its own norm,
  rotary and activation arithmetic, so a verify or mixed step (the layer's torch modules) gave other bits;
- compiled decode graphs are off (EngineConfig.graph_max_bs): Inductor's fused norms sum in another order than
  the eager steps beside them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ringserve.kernels.attention.torch_paged import TorchPagedBackend

if TYPE_CHECKING:
    from ringserve.actors.engine.runner.model_runner import ModelRunner


def make_row_invariant(runner: ModelRunner) -> None:
    """Switch `runner`'s attention and layers to their row-invariant paths; ValueError where it has none (not
    the CPU paged decode kernel: another device or KV dtype, or our CPU kernels not built)."""
    backend = runner.backend
    if not isinstance(backend, TorchPagedBackend) or not backend.in_place_decode:
        raise ValueError("--enable-deterministic-inference needs the CPU's paged attention kernel (a CPU, float32 KV "
                         "and our CPU kernels built)")
    if runner.graphs is not None:
        raise ValueError("--enable-deterministic-inference runs no compiled decode graphs (EngineConfig.graph_max_bs)")
    backend.row_invariant = True
    for layer in runner.model.decoder_layers():
        layer.fused_decode = False
