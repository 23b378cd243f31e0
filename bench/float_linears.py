"""Every float32 linear of a decode or prefill step, by each float32 kernel and by the plan this host measures.

    .venv/bin/python bench/float_linears.py [--rows 1,2,4,8,16,32,64,256] [--threads 2] [--rounds 5]

A step of SmolLM2-135M multiplies its rows by 30 layers of fused projections (qkv 576->960, o 576->576,
gate_up 576->3072, down 1536->576), distinct tensors as in the model so that they stream from memory, and by
the tied 49152-row head (decode steps only: up to 64 rows). At each row count this times, interleaved and
the minimum of `--rounds` rounds (`ringserve.kernels.cpu.host.time_interleaved`), the whole step's linears by
torch's `F.linear` (MKL, the baseline), our GEMV (`f32_gemv`, 1-3 rows), oneDNN's matmul, and the plan
`ringserve.kernels.linear_plan.measure.measure_float` chooses here (measured first, uncached, at the same thread count),
and prints each as milliseconds and as a ratio to `F.linear`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ringserve.kernels.cpu as cpu_kernels  # noqa: E402
from ringserve.kernels.cpu.host import time_interleaved  # noqa: E402
from ringserve.kernels.float_linear import onednn_linear  # noqa: E402
from ringserve.kernels.linear_plan import kernel_for  # noqa: E402
from ringserve.kernels.linear_plan.candidates import GEMV_MAX_ROWS, float_candidates  # noqa: E402
from ringserve.kernels.linear_plan.measure import measure_float  # noqa: E402

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 576, 1536, 30, 49152
LAYER_SHAPES = [(960, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]  # (out, in)
HEAD_MAX_ROWS = 64


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,2,4,8,16,32,64,256", help="comma-separated row counts")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per row count")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    row_counts = [int(r) for r in args.rows.split(",")]
    layers = [torch.randn(n, k) for _ in range(LAYERS) for n, k in LAYER_SHAPES]
    head = torch.randn(VOCAB, HIDDEN)
    shape_rows = {**{s: row_counts for s in LAYER_SHAPES},
                  (VOCAB, HIDDEN): [r for r in row_counts if r <= HEAD_MAX_ROWS]}
    plan = measure_float(shape_rows, use_cache=False).plan
    gemv = cpu_kernels.f32_linear()
    run: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
        "float32": F.linear, "f32_gemv": lambda x, w: gemv(x, w, None),
        "onednn": lambda x, w: onednn_linear(x, w, None)}
    print(f"threads {args.threads}; our kernels' ISA path: {cpu_kernels.isa()}; GEMV up to {GEMV_MAX_ROWS} rows")
    names = ["F.linear", "f32_gemv", "onednn", "plan"]
    print("| rows | " + " | ".join(names) + " | " + " | ".join(f"{n} vs F.linear" for n in names[1:]) + " |")
    print("|---" * (2 * len(names)) + "|")
    with torch.no_grad():
        for rows in row_counts:
            xs = {k: torch.randn(rows, k) for k in (HIDDEN, INTERMEDIATE)}
            weights = layers + ([head] if rows <= HEAD_MAX_ROWS else [])

            def step(choose: Callable[[torch.Tensor], str]) -> Callable[[], None]:
                def linears() -> None:
                    for w in weights:
                        run[choose(w)](xs[w.shape[1]], w)
                return linears

            fns = {"F.linear": step(lambda w: "float32")}
            for kernel in float_candidates(rows)[1:]:
                fns[kernel] = step(lambda w, kernel=kernel: kernel)
            fns["plan"] = step(lambda w: kernel_for(plan[tuple(w.shape)], rows, "float32"))
            secs = time_interleaved(fns, args.rounds)
            base = secs["F.linear"]
            cells = [f"{secs[n] * 1e3:.1f} ms" if n in secs else "-" for n in names]
            ratios = [f"{base / secs[n]:.2f}×" if n in secs else "-" for n in names[1:]]
            print(f"| {rows} | " + " | ".join(cells + ratios) + " |", flush=True)


if __name__ == "__main__":
    main()
