"""Decode steps served while a graph compiles in the background: the compile thread giving way to steps
(kernels/cpu/give_way.cpp, as served) against not, on SmolLM2-135M `gguf` at batch 1, one torch thread.

    .venv/bin/python bench/compile_give_way.py [--pairs 1]

Each run is its own process with an empty Inductor cache (a cold compile, as on a new host): it compiles the
batch-1 graph for one thread, then asks for the two-thread one and steps one request on the first graph,
with a 2 ms pause between steps (the ring's gap), until the second is ready. It prints the compile's time and
the steps' median, p99 and worst time; the modes alternate per pair.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def run(give_way: bool) -> dict[str, float]:
    """One measurement in this process (the child)."""
    import torch

    import ringserve.actors.engine.runner.graphs.graph_compiler as graph_compiler
    from bench.compile_check import build_engine, prompt_ids
    from ringserve.bus.messages import SamplingParams, TokenizedRequest

    if not give_way:
        graph_compiler.give_way_to_steps = lambda on: None  # type: ignore[assignment]
    torch.set_num_threads(1)
    engine = build_engine("SmolLM2-135M-Instruct", "gguf", 1)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.compiler is not None
    graphs.compiler.choose = False
    engine.start_decode_graphs()
    assert graphs.compiler.wait((1, 1), 1800)
    params = SamplingParams(max_new_tokens=1000, temperature=0.0, ignore_eos=True)
    added = 0
    times: list[float] = []
    graphs.compiler.request((1, 2))
    started = time.perf_counter()
    while graphs.compiler.ready((1, 2)) is None:
        if not engine.has_work():
            added += 1
            engine.add_request(TokenizedRequest(f"r{added}", prompt_ids(engine, 0, 64), params))
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
        time.sleep(0.002)
    times.sort()
    return {"compile_s": time.perf_counter() - started, "steps": len(times),
            "median_ms": statistics.median(times) * 1e3, "p99_ms": times[int(len(times) * 0.99)] * 1e3,
            "max_ms": times[-1] * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=1)
    parser.add_argument("--child", choices=["on", "off"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run(args.child == "on")))
        return
    from ringserve.kernels.cpu.host import cpu_info

    print(f"host: {cpu_info().get('model', '?')}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("| give way | compile s | steps | step median ms | p99 ms | worst ms |\n|---|---:|---:|---:|---:|---:|")
    for _ in range(args.pairs):
        for mode in ("on", "off"):
            with tempfile.TemporaryDirectory() as cache:
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
                out = subprocess.run([sys.executable, __file__, "--child", mode], env=env, capture_output=True,
                                     text=True, check=True).stdout.strip().splitlines()[-1]
            r = json.loads(out)
            print(f"| {mode} | {r['compile_s']:.0f} | {r['steps']} | {r['median_ms']:.1f} | {r['p99_ms']:.0f} | "
                  f"{r['max_ms']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
