"""What each of the graph compiler's Inductor options buys a compiled decode step: the decode forward compiled
in one process with the served options (`actors/engine/runner/graphs/graph_compiler.py` `compile_options`) and once per
variant that undoes one of them, called in turn.

    python bench/compile_options.py [--quantization gguf] [--batch 1] [--threads 1] [--variants guards,asserts]

Variants: `guards` checks the graph's guards (every parameter's and input's layout, torch's global state) on every
call, where the served graph checks them once when compiled or loaded; `asserts` keeps the wrapper's size, stride
and alignment checks. Prints the best time per call of each (the minimum over interleaved rounds)
and each variant's time over the served one's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from ringserve.actors.engine.runner.graphs.graph_compiler import bind, compile_graph, compile_options, configure_inductor  # noqa: E402
from bench.compile_check import build_engine  # noqa: E402
from ringserve.kernels.cpu.host import time_interleaved  # noqa: E402

VARIANTS = ("guards", "asserts")


def main() -> None:
    parser = argparse.ArgumentParser(description="A compiled decode forward with the served Inductor options "
                                                 "against variants that undo one of them.")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--quantization", default="gguf")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {list(VARIANTS)}")
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {list(VARIANTS)}")
    torch.set_num_threads(args.threads)
    engine = build_engine(args.model, args.quantization, args.batch)
    compiler = engine.runner.graphs.compiler
    configure_inductor()
    inputs = compiler.dummy_inputs(args.batch)
    module, served = compiler.module, compile_options()
    graphs = {"served": bind(compile_graph(module, inputs, served), module)}
    if "guards" in variants:
        checked = compile_graph(module, inputs, served)
        graphs["guards"] = lambda *a: checked(module, *a)
    if "asserts" in variants:
        graphs["asserts"] = bind(compile_graph(module, inputs, {**served, "size_asserts": True,
                                                                "alignment_asserts": True}), module)
    reference = graphs["served"](*inputs)
    for name, graph in graphs.items():
        assert torch.equal(graph(*inputs), reference), f"the {name} compile disagrees with the served one"
    print(f"{args.quantization}, batch {args.batch}, {args.threads} thread(s): ms per compiled forward")
    for _ in range(args.rounds):
        times = time_interleaved({name: (lambda g=graph: g(*inputs)) for name, graph in graphs.items()},
                                 rounds=15, target_s=0.05)
        base = times["served"]
        print("  served {:.2f}  ".format(base * 1e3) + "  ".join(
            f"{name} {times[name] * 1e3:.2f} ({times[name] / base:.2f}x)" for name in variants))


if __name__ == "__main__":
    main()
