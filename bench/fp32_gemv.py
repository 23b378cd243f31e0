"""How fast this host's float32 GEMV reads a decode step's weights, against the memory's own speed.

    .venv/bin/python bench/fp32_gemv.py [--threads 1,2] [--repeats 2]

A one-stream float32 decode step multiplies one row by every weight of the model: 30 layers of SmolLM2-135M's
projections (q, k, v, o, gate, up, down) and the tied 49152-row head, 538 MB read once each, distinct tensors
as in the model so that nothing stays in cache. For each thread count this times, medians of 9, (1) a plain sum
over a tensor of the same size (what streaming the memory costs), (2) `F.linear` of every weight, as the model
and transformers run them (MKL's GEMV), and (3) the same products with each weight stored transposed
(`x @ W^T` from a `[K, N]` tensor), and prints each as GB/s and (2) against (1) and (3). Both products are
float32 sums over the same terms, in different orders: their logits differ in the last bits.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

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
    p.add_argument("--repeats", type=int, default=2, help="rounds of the three measurements per thread count")
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

    print(f"a step's weights: {gb * 1e3:.0f} MB float32")
    print("| threads | sum (memory) | F.linear | x @ W^T (transposed) | F.linear / memory | transposed / F.linear |")
    print("|---|---|---|---|---|---|")
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for _ in range(args.repeats):
            mem, lin, tr = (median_seconds(fn) for fn in (flat.sum, linear, linear_transposed))
            print(f"| {threads} | {gb / mem:.1f} GB/s ({mem * 1e3:.1f} ms) | {gb / lin:.1f} GB/s ({lin * 1e3:.1f} ms) "
                  f"| {gb / tr:.1f} GB/s ({tr * 1e3:.1f} ms) | {mem / lin:.2f}× | {lin / tr:.2f}× |")
    x = rows[HIDDEN]
    diff = (F.linear(x, weights[-1]) - torch.mm(x, transposed[-1])).abs().max().item()
    print(f"largest difference of the head's outputs, F.linear against transposed: {diff:.2e}")


if __name__ == "__main__":
    main()
