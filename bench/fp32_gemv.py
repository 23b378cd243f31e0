"""How fast this host's float32 GEMV reads a decode step's weights, against the memory's own speed.

    .venv/bin/python bench/fp32_gemv.py [--threads 1,2] [--repeats 2]

A one-stream float32 decode step multiplies one row by every weight of the model: 30 layers of SmolLM2-135M's
projections (q, k, v, o, gate, up, down) and the tied 49152-row head, 538 MB read once each, distinct tensors
as in the model so that nothing stays in cache. For each thread count this times, medians of 9, (1) a plain sum
over a tensor of the same size (what streaming the memory costs), (2) `F.linear` of every weight, as
transformers runs them (MKL's GEMV), (3) the same products with each weight stored transposed (`x @ W^T`
from a `[K, N]` tensor) and (4) our float32 linear (`torch.ops.ringserve_cpu.f32_linear`, kernels/cpu/
f32_gemv.cpp, which the engine runs where it measures faster: kernels/float_linear.py), and prints each as
GB/s and as a ratio to (2). The products are float32 sums over the same terms in different orders: their
outputs differ in the last bits.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ringserve.kernels.cpu as cpu_kernels  # noqa: E402

HIDDEN, KV, INTERMEDIATE, LAYERS, VOCAB = 576, 192, 1536, 30, 49152
SHAPES = [(HIDDEN, HIDDEN), (HIDDEN, KV), (HIDDEN, KV), (HIDDEN, HIDDEN), (HIDDEN, INTERMEDIATE),
          (HIDDEN, INTERMEDIATE), (INTERMEDIATE, HIDDEN)]  # (in_features, out_features) of one layer


def median_seconds(fn: Callable[[], object], n: int = 9) -> float:
    fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    p.add_argument("--repeats", type=int, default=2, help="rounds of the measurements per thread count")
    args = p.parse_args()
    torch.manual_seed(0)
    weights = [torch.randn(o, i) for _ in range(LAYERS) for i, o in SHAPES] + [torch.randn(VOCAB, HIDDEN)]
    transposed = [w.t().contiguous() for w in weights]
    rows = {i: torch.randn(1, i) for i in (HIDDEN, INTERMEDIATE)}
    total = sum(w.numel() for w in weights)
    flat = torch.randn(total)
    gb = total * 4 / 1e9

    def linear() -> None:
        for w in weights:
            F.linear(rows[w.shape[1]], w)

    def linear_transposed() -> None:
        for w in transposed:
            torch.mm(rows[w.shape[0]], w)

    op = cpu_kernels.f32_linear() if cpu_kernels.compiled() else None

    def ours() -> None:
        for w in weights:
            op(rows[w.shape[1]], w, None)  # type: ignore[misc]

    fns = {"sum (memory)": flat.sum, "F.linear": linear, "transposed": linear_transposed}
    if op is not None:
        fns["ours"] = ours
    print(f"a step's weights: {gb * 1e3:.0f} MB float32; our kernels' ISA path: {cpu_kernels.isa()}")
    print("| threads | " + " | ".join(fns) + " | " + " | ".join(f"{name.split()[0]} vs F.linear" for name in fns
                                                      if name != "F.linear") + " |")
    print("|---" * (1 + 2 * len(fns) - 1) + "|")
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for _ in range(args.repeats):
            secs = {name: median_seconds(fn) for name, fn in fns.items()}
            cells = [f"{gb / s:.1f} GB/s ({s * 1e3:.1f} ms)" for s in secs.values()]
            ratios = [f"{secs['F.linear'] / s:.2f}×" for name, s in secs.items() if name != "F.linear"]
            print(f"| {threads} | " + " | ".join(cells + ratios) + " |")
    x = rows[HIDDEN]
    want = F.linear(x, weights[-1])
    diff = (want - torch.mm(x, transposed[-1])).abs().max().item()
    print(f"largest difference of the head's outputs from F.linear's: transposed {diff:.2e}", end="")
    print(f", ours {(want - op(x, weights[-1], None)).abs().max().item():.2e}" if op is not None else "")


if __name__ == "__main__":
    main()
