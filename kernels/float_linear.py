"""Float32 linears through our GEMV (`kernels/cpu/f32_gemv.cpp`) at the few-row calls where it measures faster on
this host than torch's own (MKL), through torch's `F.linear` everywhere else.

At one row a float32 linear only streams its weight from memory, and on some hosts MKL does that at a third of
the memory's speed (docs/benchmarks.md, "float32 on the AMD host"). `measure_gemv_rows` times both side by side
on the model's own shapes at 1, 2 and 4 rows, each call on another copy of the weight so that they stream from
memory as a decode step's do, and keeps per shape the largest row count up to which ours is faster by
`MARGIN` at every count measured; the result is cached on disk per host (`kernels.cpu.plan_cache`).
`use_f32_gemv` then turns the model's `nn.Linear` layers into `GemvLinear`s that run it at those counts.

Both compute the same float32 products and sums, in different orders, so their outputs differ in the last
bits (~1e-5 of the values); greedy output is tested against transformers' with whatever this host chose
(tests/test_float_linear.py, and every float32 equality test).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import kernels.cpu as cpu_kernels
from kernels.cpu import plan_cache

GEMV_ROWS = (1, 2, 4)  # row counts measured: decode steps of one to four requests
MARGIN = 0.95  # ours must measure at least 5% faster than torch's to be chosen (noise)
STREAM_BYTES = 96 << 20  # weight copies cycled through while timing: more than a CPU's caches hold
_SOURCE = Path(__file__).with_name("cpu") / "f32_gemv.cpp"


class GemvLinear(nn.Linear):
    """An `nn.Linear` whose calls with at most `gemv_rows` rows run `torch.ops.ringserve_cpu.f32_linear`.

    Made from a layer by `GemvLinear(linear, rows)`, it holds that layer's own weight and bias Parameters (a tied
    LM head keeps sharing the embedding's; a weight update copying into them reaches both)."""

    def __init__(self, linear: nn.Linear, gemv_rows: int) -> None:
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        self.weight = linear.weight
        if linear.bias is not None:
            self.bias = linear.bias
        self.gemv_rows = gemv_rows
        self._op = cpu_kernels.f32_linear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows > self.gemv_rows or x.dtype != torch.float32:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, self.in_features).contiguous()
        if torch.compiler.is_compiling():  # the custom op (with its fake) traces into the graph
            y = torch.ops.ringserve_cpu.f32_linear(flat, self.weight, self.bias)
        else:
            y = self._op(flat, self.weight, self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)


def gemv_candidates(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The model's linears the GEMV can run: plain `nn.Linear`s with contiguous float32 weights on the CPU."""
    return [(name, m) for name, m in model.named_modules()
            if type(m) is nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32
            and m.weight.is_contiguous() and (m.bias is None or m.bias.is_contiguous())]


def measure_gemv_rows(shapes: list[tuple[int, int]], rounds: int = 5, use_cache: bool = True
                      ) -> tuple[dict[tuple[int, int], int], dict[str, Any]]:
    """Per linear shape (out, in): up to how many rows our GEMV runs it (0: never), and the measurements
    ({"times": {"out,in,rows": {"float32": s, "f32_gemv": s}}, "cached": bool})."""
    key = plan_cache.host_key({"f32_gemv": hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:16],
                               "rows": list(GEMV_ROWS), "shapes": sorted(list(s) for s in shapes)})
    stored = plan_cache.load(key) if use_cache else None
    times: dict[str, dict[str, float]] = stored["times"] if stored else {}
    if not stored:
        op = cpu_kernels.f32_linear()
        with torch.no_grad():
            for n, k in shapes:
                copies = [torch.randn(n, k) for _ in range(max(1, -(-STREAM_BYTES // (n * k * 4))))]
                for rows in GEMV_ROWS:
                    x = torch.randn(rows, k)
                    turn = [0]

                    def next_weight() -> torch.Tensor:
                        turn[0] = (turn[0] + 1) % len(copies)
                        return copies[turn[0]]

                    times[f"{n},{k},{rows}"] = plan_cache.time_interleaved(
                        {"float32": lambda: F.linear(x, next_weight()), "f32_gemv": lambda: op(x, next_weight(), None)},
                        rounds)
                del copies
        if use_cache:
            plan_cache.store(key, {"times": times})
    chosen = {}
    for n, k in shapes:
        upto = 0
        for rows in GEMV_ROWS:
            measured = times[f"{n},{k},{rows}"]
            if measured["f32_gemv"] > MARGIN * measured["float32"]:
                break
            upto = rows
        chosen[(n, k)] = upto
    return chosen, {"times": times, "cached": bool(stored)}


def use_f32_gemv(model: nn.Module, gemv_rows: dict[tuple[int, int], int]) -> int:
    """Make each of the model's `gemv_candidates` a `GemvLinear` where its shape's entry of `gemv_rows` is > 0, in
    place; returns how many were."""
    swapped = 0
    for name, module in gemv_candidates(model):
        rows = gemv_rows.get((module.out_features, module.in_features), 0)
        if rows > 0:
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, GemvLinear(module, rows))
            swapped += 1
    return swapped


def gemv_report(model: nn.Module) -> dict[str, str]:
    """Which shapes run the GEMV, for logs and `/get_server_info`: {"576->1536 1-4 rows": "f32_gemv", ...}
    (in->out features); {} when none does."""
    by_shape = {(m.out_features, m.in_features): m for m in model.modules() if isinstance(m, GemvLinear)}
    return {f"{m.in_features}->{m.out_features} 1-{m.gemv_rows} rows": "f32_gemv" for m in by_shape.values()}
