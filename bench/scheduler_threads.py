"""How OpenMP's waiting and a second OpenMP team change a compiled batch-1 decode step on two threads.

    python bench/scheduler_threads.py [--quantization gguf] [--pairs 2] [--spin 3000]

OpenMP's wait policy is read once per process, so each setting runs in a child process of its own, the
settings alternated `--pairs` times: the scheduler's (`GOMP_SPINCOUNT` = --spin, actors/scheduler/__main__.py),
`OMP_WAIT_POLICY=PASSIVE` (what it used before) and libgomp's default (~3 ms of spinning). In each child, the
engine is built as compile_check.py builds it, one request decodes on the compiled graph of batch 1 on two
threads, and the median step is timed alone, then while a second thread that once ran a parallel op lives
(its own OpenMP team, which the scheduler's event loop no longer starts: actors/scheduler/engine_thread.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def child(quantization: str, steps: int) -> dict[str, float]:
    """Median step ms alone and beside a second OpenMP team (in this process, with its OpenMP settings)."""
    import torch

    from bench.compile_check import build_engine, prompt_ids
    from ringserve.bus.messages import SamplingParams, TokenizedRequest

    torch.set_num_threads(2)
    engine = build_engine("SmolLM2-135M-Instruct", quantization, 1)
    graphs = engine.runner.graphs
    graphs.compiler.choose = False
    engine.start_decode_graphs()
    graphs.compiler.wait((1, 2), 1800)
    params = SamplingParams(max_new_tokens=4 * steps + 20, temperature=0.0, ignore_eos=True)
    engine.add_request(TokenizedRequest("a", prompt_ids(engine, 0, 128), params))
    for _ in range(5):
        engine.step()

    def median_step() -> float:
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    alone = median_step()
    started, stop = threading.Event(), threading.Event()

    def second_team() -> None:
        torch.set_num_threads(2)
        x = torch.randn(1 << 20)
        x.add_(1)  # a parallel op: this thread's own OpenMP team, kept while it lives
        started.set()
        stop.wait()

    thread = threading.Thread(target=second_team, daemon=True)
    thread.start()
    started.wait()
    beside = median_step()
    stop.set()
    return {"alone": alone, "second team": beside}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quantization", default="gguf")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--spin", type=int, default=3000)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.quantization, args.steps)))
        return
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    settings = {f"GOMP_SPINCOUNT={args.spin} (served)": {"GOMP_SPINCOUNT": str(args.spin)},
                "OMP_WAIT_POLICY=PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"}, "libgomp default": {}}
    print(f"{args.quantization}, batch 1, 2 threads, 128-token context: median step ms")
    for pair in range(args.pairs):
        for name, extra in settings.items():
            out = subprocess.run([sys.executable, __file__, "--child", "--quantization", args.quantization,
                                  "--steps", str(args.steps)], env={**base, **extra}, capture_output=True,
                                 text=True, check=True)
            result = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"  round {pair + 1} {name:32s} alone {result['alone']:6.2f}   beside a second team "
                  f"{result['second team']:6.2f} ({result['second team'] / result['alone']:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
