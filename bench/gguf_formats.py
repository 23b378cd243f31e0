"""Our CPU kernels on each GGUF block type, against the q8_0 kernel and float32, in one process.

    .venv/bin/python bench/gguf_formats.py [--layers 18] [--rows 1,32] [--reps 20] [--isa avx2]

The weights are a decoder's linears of Qwen3 0.6B's shapes (per layer: qkv [4096, 1024], o [1024, 2048], gate_up
[6144, 1024], down [1024, 3072]; 8 layers, ~126 M weights, far more than the caches hold, so a batch-1 pass is
memory-bound as a decode step is). For each GGML type the layers hold random blocks of that type, read as a file's
(`decode_gguf_blocks`) and packed as served (`pack_by_shape`: the fewest bytes that hold them exactly); a pass runs every linear once on `rows`
activation rows. The last row, "gemma3", is Gemma 3 270M's 18 layers as its Q4_K_M file mixes them (q/k Q5_0 and v
Q8_0 fused, o Q4_K, gate/up Q5_0, down Q6_K), its "B/w gguf" that file's bytes. Prints the host, then per type and row count the median pass time, the packed bytes per
weight (and the GGUF file's own: what llama.cpp streams), the weight bytes streamed per second, and the ratios
q8_0 time / this and float32 time / this (above 1: faster than that kernel; for "gemma3" the baselines' times
are scaled to its weight count).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ringserve.kernels import cpu as cpu_kernels  # noqa: E402
from ringserve.kernels.cpu.gguf_formats import (  # noqa: E402
    BLOCK_BYTES, BLOCK_WEIGHTS, SUPPORTED_GGML_TYPES, concat_rows, decode_gguf_blocks, pack_by_shape,
    random_gguf_blocks,
)
from ringserve.kernels.cpu.packing import pack  # noqa: E402

LAYER_SHAPES = ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072))  # [out, in] of qkv, o, gate_up, down
# Gemma 3 270M Q4_K_M: per linear its parts' ([out, in], GGML type), fused row-wise
GEMMA3 = ((((1024, 640), "Q5_0"), ((256, 640), "Q5_0"), ((256, 640), "Q8_0")), (((640, 1024), "Q4_K"),),
          (((2048, 640), "Q5_0"), ((2048, 640), "Q5_0")), (((640, 2048), "Q6_K"),))


def host() -> str:
    """The CPU's model name (lscpu), its core count and torch's threads."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        name = next(line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        name = "unknown CPU"
    return f"{name}, {torch.get_num_threads()} threads, ISA {cpu_kernels.isa()}"


def time_passes(runs: list[list], xs: list[dict[int, torch.Tensor]], reps: int) -> list[float]:
    """Median seconds of one pass of each of `runs` (a pass: every (fn, in_features) called once on
    `x[in_features]`), the runs interleaved rep by rep so that load from other processes hits them alike."""
    times: list[list[float]] = [[] for _ in runs]
    for rep in range(reps + 1):
        for run, x, out in zip(runs, xs, times):
            start = time.perf_counter()
            for fn, k in run:
                fn(x[k])
            if rep:  # the first is a warm-up
                out.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def shapes(layers: int) -> list[tuple[int, int]]:
    """Every linear's [out, in] of `layers` layers."""
    return [shape for _ in range(layers) for shape in LAYER_SHAPES]


def packed_pass(linears: list[tuple[tuple[tuple[int, int], str], ...]]) -> tuple[list, float, float, int]:
    """`linears` (each its parts' shape and GGML type) in random blocks, packed as served (`pack_by_shape`): (fn,
    in_features) per linear, packed and GGUF bytes per weight, and the weights."""
    codes = {i: concat_rows([decode_gguf_blocks(random_gguf_blocks(t, n, k, seed=i), t, n, k) for (n, k), t in parts])
             for i, parts in enumerate(linears)}
    packed = pack_by_shape(codes)  # type: ignore[arg-type]
    del codes
    run = [(lambda x, p=p: cpu_kernels.packed_linear(x, p, None), p.in_features) for p in packed.values()]
    weights = sum(n * k for parts in linears for (n, k), _ in parts)
    file_bytes = sum(n * k * BLOCK_BYTES[t] / BLOCK_WEIGHTS[t] for parts in linears for (n, k), t in parts)
    forms = sorted({p.format for p in packed.values()})
    print(f"  packed as {', '.join(forms)}")
    return run, sum(p.nbytes() for p in packed.values()) / weights, file_bytes / weights, weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rows", default="1,32", help="activation rows per call, comma-separated")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--isa", choices=("avx512vnni", "avx2"), help="force an ISA path (default: the best)")
    parser.add_argument("--types", default=",".join(SUPPORTED_GGML_TYPES + ("gemma3",)))
    args = parser.parse_args()
    cpu_kernels.linear()  # loads the library
    if args.isa:
        cpu_kernels.set_isa(args.isa)
    print(f"host: {host()}")
    rows = [int(r) for r in args.rows.split(",")]
    xs = {m: {k: torch.randn(m, k) for k in {k for _, k in LAYER_SHAPES}} for m in rows}
    gemma_xs = {m: {k: torch.randn(m, k) for k in (640, 1024, 2048)} for m in rows}
    weights = sum(n * k for n, k in shapes(args.layers))
    floats = [torch.randn(n, k) * 0.02 for n, k in shapes(args.layers)]
    f32 = [(lambda x, w=w: torch.nn.functional.linear(x, w), w.shape[1]) for w in floats]
    q8 = [(lambda x, p=pack(w, "q8_0"): cpu_kernels.packed_linear(x, p, None), w.shape[1]) for w in floats]
    del floats
    print(f"baselines: {weights / 1e6:.0f} M weights as float32 and as q8_0 (from floats), timed with each type")
    print(f"{'type':6} {'M':>3} {'ms/pass':>8} {'B/w ours':>8} {'B/w gguf':>8} {'GB/s':>6} {'vs q8_0':>7} "
          f"{'vs f32':>7}")
    for ggml_type in args.types.split(","):
        if ggml_type == "gemma3":  # its own shapes: scale the baselines by its weights
            linears = [parts for _ in range(18) for parts in GEMMA3]
        else:
            linears = [(((n, k), ggml_type),) for n, k in shapes(args.layers)]
        run, per_weight, gguf_per_weight, count = packed_pass(linears)
        for m in rows:
            x = xs[m] if ggml_type != "gemma3" else gemma_xs[m]
            seconds, f32_s, q8_s = time_passes([run, f32, q8], [x, xs[m], xs[m]], args.reps)
            f32_s, q8_s = f32_s * count / weights, q8_s * count / weights
            print(f"{ggml_type:6} {m:>3} {seconds * 1e3:8.2f} {per_weight:8.3f} {gguf_per_weight:8.3f} "
                  f"{count * per_weight / seconds / 1e9:6.1f} {q8_s / seconds:7.2f} {f32_s / seconds:7.2f}")
        del run


if __name__ == "__main__":
    main()
