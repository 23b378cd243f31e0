"""What Dynamo's guards on the model's modules cost a compiled decode step: the decode forward compiled twice
in one process, as the graph compiler does (nn-module guards skipped) and with every guard, called in turn.

    python bench/compiled_guards.py [--quantization gguf] [--batch 1] [--threads 1]

Prints the best time per call of each (the minimum over interleaved rounds) and their ratio
(actors/engine/graph_compiler.py explains why skipping the guards is safe there).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from actors.engine.graph_compiler import configure_inductor, private_copy  # noqa: E402
from bench.compile_check import build_engine  # noqa: E402
from kernels.cpu.plan_cache import time_interleaved  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description="A compiled decode forward with Dynamo's module guards skipped, against all guards.")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--quantization", default="gguf")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = build_engine(args.model, args.quantization, args.batch)
    compiler = engine.runner.graphs.compiler
    configure_inductor()
    inputs = compiler.dummy_inputs(args.batch)
    forward = compiler.forward
    twin = private_copy(forward)  # a code object of its own, so the two compiles keep separate Dynamo caches
    guarded = torch.compile(forward, fullgraph=True, dynamic=False)
    skipped = torch.compile(twin, fullgraph=True, dynamic=False,
                            options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
    assert torch.equal(guarded(*inputs), skipped(*inputs)), "the two compiles disagree"
    print(f"{args.quantization}, batch {args.batch}, {args.threads} thread(s): ms per compiled forward")
    for _ in range(args.rounds):
        times = time_interleaved({"all": lambda: guarded(*inputs), "skipped": lambda: skipped(*inputs)},
                                 rounds=15, target_s=0.05)
        print(f"  all guards {times['all'] * 1e3:.2f}  module guards skipped {times['skipped'] * 1e3:.2f}  "
              f"ratio {times['all'] / times['skipped']:.2f}")


if __name__ == "__main__":
    main()
