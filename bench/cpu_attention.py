"""CPU decode attention of one layer on SmolLM2-135M's shapes (9 query heads, 3 KV heads of 64, float32): the
torch backend's gather + SDPA path against our paged kernel reading the KV pool in place (kernels/cpu), through
the backend's own `prepare` and `forward`, as a ratio.

    .venv/bin/python bench/cpu_attention.py [--batch 1 8 32] [--context 128 1024 4096] [--threads 2]

Both paths of one (batch, context) run in the same rounds, in turn, minimum kept
(`ringserve.kernels.cpu.host.time_interleaved`). A whole decode step runs this 30 times (once per layer).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ringserve.kernels.cpu as cpu_kernels  # noqa: E402
from ringserve.kernels.attention import ForwardInfo, TorchPagedBackend  # noqa: E402
from ringserve.kernels.cpu.host import cpu_info, time_interleaved  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def step(batch: int, context: int) -> tuple[TorchPagedBackend, ForwardInfo, torch.Tensor, torch.Tensor]:
    """A backend over a one-layer pool whose requests hold `context` scattered slots each, and a decode step."""
    slots = batch * context + 1
    k_pool = torch.randn(1, slots, KV_HEADS, HEAD_DIM)
    v_pool = torch.randn_like(k_pool)
    backend = TorchPagedBackend(k_pool, v_pool, HEADS)
    table = torch.randperm(slots - 1)[: batch * context].reshape(batch, context)
    rows = torch.arange(batch)
    info = ForwardInfo([1] * batch, [context] * batch, rows, table, table[:, -1].clone())
    return backend, info, torch.randn(batch, HEADS, HEAD_DIM), torch.randn(batch, KV_HEADS, HEAD_DIM)


def main() -> None:
    """Print the host, then µs per layer of each path and the kernel's speed-up."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, nargs="+", default=[128, 1024, 4096])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu_kernels.compiled():
        sys.exit("the C++ kernels did not build here: only the gather path exists")
    print(f"host: {cpu_info()['model']}; torch {torch.__version__}; {torch.get_num_threads()} threads")
    print(f"{'batch':>5} {'context':>7} {'gather µs':>10} {'kernel µs':>10} {'speed-up':>8}")
    for batch in args.batch:
        for context in args.context:
            backend, info, q, kv = step(batch, context)

            def run(in_place: bool) -> object:
                backend.in_place_decode = in_place
                return backend.forward(q, kv, kv, 0, backend.prepare(info))

            times = time_interleaved({"gather": lambda: run(False), "kernel": lambda: run(True)}, args.rounds)
            print(f"{batch:>5} {context:>7} {times['gather'] * 1e6:>10.0f} {times['kernel'] * 1e6:>10.0f} "
                  f"{times['gather'] / times['kernel']:>7.2f}×")


if __name__ == "__main__":
    main()
