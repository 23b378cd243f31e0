"""One-row (decode, batch 1) linears: float32 against our quantized kernels, per ISA path, in one process.

    .venv/bin/python bench/one_row_kernels.py [--isa avx2,avx512vnni] [--rounds 7] [--models smollm2,gemma3]
                                             [--formats q4_0,q4_1,q8_0,q8_k,q4_k,q5_k,q6_k] [--no-heads] [--threads N]

For SmolLM2-135M's and Gemma 3 270M's linear shapes ([out, in]; the LM heads too unless `--no-heads`), a random
weight is packed in each format and one activation row is run through torch's `F.linear` on the float32 weight,
our `f32_gemv` (kernels/cpu/f32_gemv.cpp) and each format's kernel (`packed_linear`), timed as the kernel plan
times them (`time_interleaved`: the best of `--rounds` rounds that run every candidate in turn, one weight each,
as kernels/linear_plan/measure.py's quantized pass does). The heads run only the formats their files use
(q8_0, q6_k). Prints per ISA path, shape and kernel microseconds per call and the ratio torch-float32 time /
kernel time (above 1: faster than float32; the plan takes a kernel at 1.05 or more, candidates.MARGIN).
`--isa avx2` on an AVX-512 VNNI host forces the AVX2 path (`set_isa`), which is how AVX2 is measured there.
Figures hold as ratios measured side by side; the host's other load moves the absolute times.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ringserve.kernels.cpu as cpu_kernels  # noqa: E402
from ringserve.kernels.cpu.host import cpu_info, time_interleaved  # noqa: E402
from ringserve.kernels.cpu.packing import FORMATS, pack  # noqa: E402

SHAPES = {  # [out, in] of each model's linears (the head last)
    "smollm2": ((576, 576), (1536, 576), (576, 1536), (49152, 576)),
    "gemma3": ((640, 640), (1024, 640), (2048, 640), (640, 2048), (262144, 640)),
}
HEAD_FORMATS = ("q8_0", "q6_k")
HEAD_ROWS = 32768  # heads are row-split evenly over threads: a slice keeps the packing quick, and the timing per row


def time_shape(n: int, k: int, formats: list[str], rounds: int) -> dict[str, float]:
    """Seconds per one-row call of each kernel on a random `[n, k]` weight."""
    torch.manual_seed(0)
    weight = torch.randn(n, k) / k ** 0.5
    x = torch.randn(1, k)
    gemv = cpu_kernels.f32_linear()
    fns = {"float32": lambda: F.linear(x, weight), "f32_gemv": lambda: gemv(x, weight, None)}
    for fmt in formats:
        packed = pack(weight, fmt)
        fns[fmt] = lambda packed=packed: cpu_kernels.packed_linear(x, packed, None)
    return time_interleaved(fns, rounds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--isa", default="avx2,avx512vnni", help="comma-separated ISA paths (those this CPU has)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--models", default="smollm2,gemma3")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--no-heads", action="store_true", help="skip the LM heads (the packing takes a while)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu_kernels.compiled():
        sys.exit("the CPU kernels are not built here: nothing to compare")
    info = cpu_info()
    print(f"host: {info['model']}; best ISA {cpu_kernels.best_isa()}; torch threads {torch.get_num_threads()}")
    formats = args.formats.split(",")
    isas = [isa for isa in args.isa.split(",") if isa == "avx2" or cpu_kernels.best_isa() == isa]
    for model in args.models.split(","):
        for n, k in SHAPES[model]:
            head = n > 16384
            if head and args.no_heads:
                continue
            fmts = [f for f in formats if f in HEAD_FORMATS] if head else formats
            rows = min(n, HEAD_ROWS)
            for isa in isas:
                cpu_kernels.set_isa(isa)
                times = time_shape(rows, k, fmts, args.rounds)
                base = times["float32"]
                shape = f"{n}x{k}" + (f" ({rows} rows)" if rows < n else "")
                cells = "  ".join(f"{name} {t * 1e6:7.1f}us {base / t:4.2f}x" for name, t in times.items())
                print(f"{model:8s} {isa:10s} {shape:>20s}  {cells}", flush=True)
    cpu_kernels.set_isa(cpu_kernels.best_isa())


if __name__ == "__main__":
    main()
