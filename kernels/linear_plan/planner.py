"""The one door to kernel plans: `plan_linears` measures (or reads from the cache) and chooses, for a model and
a `--quantization` method, which kernel each linear shape runs at each row count; the caller then swaps the
layers in (`quantize_linears`, `use_float_plan`) and logs what it got.

- `int8`, `int4`: each shape among its method's kernels and the float32 weight's; a shape only int4's LM
  head has (int4 keeps the head at int8, `layer_method`) among int8's.
- `gguf`: each shape among float32 and the block format its layers' GGUF weights have (one per shape);
  `gptq` and `awq` (a checkpoint's 4-bit codes, packed as q4_k): that kernel at every row count, unmeasured (the
  checkpoint has no float weights to run, and none is kept).
- `none`: each float32 shape among torch's, our GEMV and oneDNN's (nothing measured where no kernel but
  torch's is a candidate here); with `bf16` (the engine's verdict: a bfloat16 checkpoint, `--float-kernels
  auto`) oneDNN's bfloat16 matmul too.
- `auto`: the `int8` plan, taken if it is at least `AUTO_MIN_SPEEDUP` times faster than the fastest float32
  kernels at every batch of `AUTO_BATCHES`; else the `none` plan (with `bf16` as for `none`).

With `deterministic` (`--enable-deterministic-inference`) every shape runs one row-invariant kernel at every
row count instead (`invariant.py`), nothing measured (auto still measures, to choose its method).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from ringserve.kernels.cpu.packing import PackedWeight
from ringserve.kernels.float_linear import float_linears
from ringserve.kernels.linear_plan.candidates import float_plan_possible
from ringserve.kernels.linear_plan.invariant import invariant_plan
from ringserve.kernels.linear_plan.measure import ShapeRows, measure_float, measure_quantized
from ringserve.kernels.linear_plan.plan import KernelPlan, Measured
from ringserve.kernels.linear_plan.report import speedup
from ringserve.kernels.quantization import CHECKPOINT_METHODS, PACKED_METHODS, layer_method

AUTO_MIN_SPEEDUP = 1.15  # int8 costs some quality; take it only for a clear win
AUTO_BATCHES = (1, 16)


@dataclass
class LinearPlan:
    """What `plan_linears` chose: the method the layers run ("none", "int8", "int4" or "gguf"; auto's
    verdict), the kernel per shape and row-count bucket, the measuring passes in the order they ran (one per
    kind measured; auto's int8 pass stays when it lost), and, for auto, int8's speedup per batch size."""

    method: str
    plan: KernelPlan
    passes: list[Measured] = field(default_factory=list)
    auto_speedups: dict[int, float] = field(default_factory=dict)


def linear_shapes(model: nn.Module) -> list[tuple[int, int]]:
    """The distinct (out_features, in_features) of the model's `nn.Linear` layers."""
    return sorted({(m.out_features, m.in_features) for m in model.modules() if isinstance(m, nn.Linear)})


def plan_linears(model: nn.Module, rows: ShapeRows, method: str,
                 packed: dict[str, PackedWeight] | None = None, bf16: bool = False,
                 deterministic: bool = False) -> LinearPlan:
    """The kernel plan of `model`'s linears for `method` ("none", "int8", "int4", "gguf" or "auto"), each shape
    measured at its `rows` (shape -> row counts). With "gguf", `packed` holds every linear's GGUF blocks.
    `bf16`: the unquantized layers may also run the bfloat16 kernel (their weights are a bfloat16
    checkpoint's). `deterministic`: one row-invariant kernel per shape at every row count, unmeasured."""
    if deterministic:
        chosen = plan_linears(model, rows, method, packed) if method == "auto" else LinearPlan(method, {})
        return LinearPlan(chosen.method, invariant_plan(_shape_kinds(model, chosen.method, packed), rows),
                          chosen.passes, chosen.auto_speedups)
    if method in CHECKPOINT_METHODS:  # a checkpoint's codes: their kernel at every row count, nothing measured
        return LinearPlan(method, {})
    if method in PACKED_METHODS:
        blocks = _one_pass(method, _gguf_groups(rows, packed or {}))
        return LinearPlan(method, blocks.plan, [blocks])
    if method == "none":
        return _float_plan(model, rows, bf16)
    measured_as = "int8" if method == "auto" else method
    quantized = _one_pass(measured_as, _quantized_groups(model, rows, measured_as))
    if method != "auto":
        return LinearPlan(method, quantized.plan, [quantized])
    speedups = {batch: speedup(quantized.times, quantized.plan, batch) for batch in AUTO_BATCHES}
    if min(speedups.values()) >= AUTO_MIN_SPEEDUP:
        return LinearPlan("int8", quantized.plan, [quantized], speedups)
    unquantized = _float_plan(model, rows, bf16)
    return LinearPlan("none", unquantized.plan, [quantized, *unquantized.passes], speedups)


def _shape_kinds(model: nn.Module, method: str, packed: dict[str, PackedWeight] | None) -> dict[tuple[int, int], str]:
    """Each linear shape's kind for a row-invariant plan: its block format ("gguf": a shape the file stores as
    floats is "none"), its `layer_method` (int8, int4), or "none"."""
    if method in PACKED_METHODS:
        kinds = {shape: "none" for shape in linear_shapes(model)}
        kinds.update(_gguf_formats(packed or {}))
        return kinds
    kinds: dict[tuple[int, int], str] = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):  # a shape both int4's layers and its int8 head have runs int4's kernel
            shape = (m.out_features, m.in_features)
            kinds[shape] = method if kinds.get(shape) == method else layer_method(name, method)
    return kinds


def _float_plan(model: nn.Module, rows: ShapeRows, bf16: bool) -> LinearPlan:
    if not float_plan_possible():
        return LinearPlan("none", {})
    shapes = {(m.out_features, m.in_features) for _, m in float_linears(model)}
    selected = {s: r for s, r in rows.items() if s in shapes}
    measured = measure_float(selected, bf16=True) if bf16 else measure_float(selected)
    return LinearPlan("none", measured.plan, [measured])


def _quantized_groups(model: nn.Module, rows: ShapeRows, method: str) -> dict[str, ShapeRows]:
    """Shapes to measure per kind: `method`'s, and (int4) the shapes only its int8 LM head has as int8."""
    kinds: dict[tuple[int, int], set[str]] = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            kinds.setdefault((m.out_features, m.in_features), set()).add(layer_method(name, method))
    groups: dict[str, ShapeRows] = {}
    for shape, shape_rows in rows.items():
        kind = method if method in kinds.get(shape, {method}) else min(kinds[shape])
        groups.setdefault(kind, {})[shape] = shape_rows
    return dict(sorted(groups.items(), key=lambda item: item[0] != method))  # the method's own shapes first


def _gguf_formats(packed: dict[str, PackedWeight]) -> dict[tuple[int, int], str]:
    """Each packed shape's GGUF block format (one format per shape, else the file cannot be run so)."""
    formats: dict[tuple[int, int], set[str]] = {}
    for p in packed.values():
        formats.setdefault((p.out_features, p.in_features), set()).add(p.format)
    mixed = {shape: sorted(f) for shape, f in formats.items() if len(f) > 1}
    if mixed:
        raise ValueError(f"--quantization gguf: layers of one shape hold different block types {mixed}")
    return {shape: fmt for shape, (fmt,) in formats.items()}


def _gguf_groups(rows: ShapeRows, packed: dict[str, PackedWeight]) -> dict[str, ShapeRows]:
    """Shapes to measure per GGUF block format."""
    groups: dict[str, ShapeRows] = {}
    for shape, fmt in _gguf_formats(packed).items():
        groups.setdefault(fmt, {})[shape] = rows[shape]
    return dict(sorted(groups.items()))


def _one_pass(kind: str, groups: dict[str, ShapeRows]) -> Measured:
    """Measure each group among its kind's kernels, in order, as one pass of `kind`: the plans and times
    merged, cached only if every group was."""
    parts = [measure_quantized(shape_rows, group) for group, shape_rows in groups.items()]
    plan = {shape: shape_plan for part in parts for shape, shape_plan in part.plan.items()}
    return Measured(kind, plan, {e: t for part in parts for e, t in part.times.items()},
                    all(part.cached for part in parts), tuple(dict.fromkeys(k for part in parts for k in part.candidates)),
                    sum(part.seconds for part in parts))
