"""CPU linear kernels side by side on SmolLM2-135M's shapes: float32, our int8 and int4 group kernels (each ISA
path this CPU has), and the per-row int8 `torch._int_mm` path (fbgemm at one row), as ratios to float32.

    .venv/bin/python bench/cpu_kernels.py [--rows 1 8 32] [--threads 2] [--rounds 7]

Every kernel of one shape and row count is timed in the same rounds, in turn, and the minimum kept
(`ringserve.kernels.cpu.host.time_interleaved`), so load from other processes hits all of them alike. The last
table line sums every linear of one decoder step at that row count (30 layers: qkv, o, gate_up, down; plus the
LM head) as a decode step would run them.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ringserve.kernels.cpu as cpu_kernels  # noqa: E402
from ringserve.kernels.cpu.host import cpu_info, time_interleaved  # noqa: E402
from ringserve.kernels.quantization import QuantLinear  # noqa: E402

# SmolLM2-135M: hidden 576, intermediate 1536, 9 heads / 3 KV heads of 64, 30 layers, vocab 49152 (tied head)
SHAPES = {"qkv 576->960": (960, 576, 30), "o 576->576": (576, 576, 30), "gate_up 576->3072": (3072, 576, 30),
          "down 1536->576": (576, 1536, 30), "lm_head 576->49152": (49152, 576, 1)}
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "amx_int8")


def kernels_to_time() -> list[tuple[str, str, str | None]]:
    """(column name, kernel, ISA path) for every kernel this host can run."""
    out: list[tuple[str, str, str | None]] = [("float32", "float32", None)]
    if cpu_kernels.compiled():
        paths = ["avx512vnni", "avx2"] if cpu_kernels.best_isa() == "avx512vnni" else ["avx2"]
        for path in paths:
            out += [(f"q8_0 {path}", "q8_0", path), (f"q4_1 {path}", "q4_1", path)]
    if "fbgemm" in torch.backends.quantized.supported_engines:
        out.append(("int_mm", "int_mm", None))
    return out


def _call(layer: QuantLinear, x: torch.Tensor, kernel: str, path: str | None) -> Callable[[], object]:
    """One timed call: the ISA path is set on every call (a few hundred ns), so all paths share the rounds."""
    if path is None:
        return lambda: layer.run(x, kernel)
    return lambda: (cpu_kernels.set_isa(path), layer.run(x, kernel))


def main() -> None:
    """Print the host, then one table row per shape and row count: µs of float32 and each kernel's ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu = cpu_info()
    flags = set(cpu["flags"].split())
    print(f"host: {cpu['model']} ({platform.machine()}), {torch.get_num_threads()} threads, "
          f"ISA flags: {' '.join(f for f in ISA_FLAGS if f in flags) or 'none of ' + ', '.join(ISA_FLAGS)}")
    print(f"date: {time.strftime('%Y-%m-%d %H:%M %Z')}; torch {torch.__version__}; "
          f"kernels compiled: {cpu_kernels.compiled()} (best ISA path: {cpu_kernels.isa()})")
    columns = kernels_to_time()
    best_isa = cpu_kernels.isa()
    print("| shape | rows | float32 µs | " + " | ".join(f"{c} ×" for c, _, _ in columns[1:]) + " |")
    print("|---|---:|---:|" + "---:|" * (len(columns) - 1))
    torch.manual_seed(0)
    with torch.no_grad():
        hold = tuple({kernel for _, kernel, _ in columns})
        layers = {name: QuantLinear(nn.Linear(k, n, bias=False), "int8", hold=hold)
                  for name, (n, k, _) in SHAPES.items()}
        for rows in args.rows:
            step = {c: 0.0 for c, _, _ in columns}
            for name, (n, k, count) in SHAPES.items():
                x = torch.randn(rows, k)
                layer = layers[name]
                fns = {c: _call(layer, x, kernel, path) for c, kernel, path in columns}
                times = time_interleaved(fns, args.rounds)
                for c in step:
                    step[c] += times[c] * count
                print(f"| {name} | {rows} | {times['float32'] * 1e6:.0f} | "
                      + " | ".join(f"{times['float32'] / times[c]:.2f}" for c, _, _ in columns[1:]) + " |", flush=True)
            if cpu_kernels.compiled():
                cpu_kernels.set_isa(best_isa)
            print(f"| **all linears of a step** | {rows} | {step['float32'] * 1e6:.0f} | "
                  + " | ".join(f"**{step['float32'] / step[c]:.2f}**" for c, _, _ in columns[1:]) + " |", flush=True)


if __name__ == "__main__":
    main()
