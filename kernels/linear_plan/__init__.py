"""Which kernel runs each linear layer, at each row count, on this host: the one owner of kernel plans.

- `plan.py`: the plan's types (`ShapePlan`, `KernelPlan`, `Measured`), `kernel_for` (what a layer reads on
  each call) and the plan as readable row-count ranges.
- `candidates.py`: which kernels are candidates per method or block format on this host, and the choice
  rules (the margin over torch's float32, quality first in a near tie).
- `measure.py`: timing the candidates side by side on the model's shapes; `cache.py`: those timings on disk,
  keyed by the host.
- `planner.py`: `plan_linears(model, rows, method)`, the one call the engine makes
  (actors/engine/quantization/quantize.py); `report.py`: what the layers run, for `/get_server_info`, the
  log and `--quantization auto`.

The layers (`QuantLinear` in kernels/quantization.py, `FloatLinear` in kernels/float_linear.py) only run what
a plan chose. Only `plan.py` is imported here: the layers import it, and the measuring modules import them.
"""

from ringserve.kernels.linear_plan.plan import KernelPlan, Measured, ShapePlan, kernel_for, plan_report

__all__ = ["KernelPlan", "Measured", "ShapePlan", "kernel_for", "plan_report"]
