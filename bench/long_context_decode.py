"""Decode steps with long contexts: the CPU paged kernel reading the KV pool in place against the torch path's
per-layer gather, whole steps of one engine, as a ratio (issue 20's "32 streams with 1k-token prompts").

    .venv/bin/python bench/long_context_decode.py --batch 32 --context 1024 --quantization gguf

Builds the engine as the server does but eager (compiled graphs would fix one attention path into the graph),
prefills `--batch` prompts of `--context` tokens, then runs decode steps alternating the two attention paths
on the same requests (the same load on the machine), and prints the median step of each, decode tok/s and the
ratio, with the host and date.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.compile_check import prompt_ids  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--quantization", default="none", help="a --quantization method")
    parser.add_argument("--batch", type=int, default=32, help="requests decoding together")
    parser.add_argument("--context", type=int, default=1024, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=12, help="decode steps timed per attention path")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: every core)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from ringserve.actors.common.model_source import resolve_model
    from ringserve.actors.engine.config import EngineConfig
    from ringserve.actors.engine.scheduling.engine_core import EngineCore
    from ringserve.bus.messages import SamplingParams, TokenizedRequest
    from ringserve.kernels.cpu.host import cpu_info

    config = EngineConfig(device="cpu", quantization=args.quantization, disable_cuda_graph=True,
                          max_running_requests=args.batch, max_total_tokens=args.batch * (args.context + 64) + 4096,
                          disable_radix_cache=True, torch_threads=torch.get_num_threads())
    engine = EngineCore.from_source(resolve_model(args.model), config)
    backend = engine.runner.backend
    if not getattr(backend, "in_place_decode", False):
        print("the paged kernel does not run here (C++ kernels not built, or not a float32 KV pool)")
        return 1
    print(f"host: {cpu_info()['model']}, {torch.get_num_threads()} torch threads, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}; {args.quantization}, batch {args.batch}, context {args.context}",
          flush=True)
    params = SamplingParams(max_new_tokens=2 * args.steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(args.batch):
        assert engine.add_request(TokenizedRequest(f"r{i}", prompt_ids(engine, i, args.context), params)) is None
    started_rids: set[str] = set()
    while len(started_rids) < args.batch:  # the prefills, until every request has its first token
        if not engine.has_work():
            print("the engine went idle before every request decoded")
            return 1
        started_rids.update(row.rid for row in engine.step())
    times: dict[bool, list[float]] = {False: [], True: []}
    for k in range(2 * args.steps):
        in_place = k % 2 == 0
        backend.in_place_decode = in_place
        started = time.perf_counter()
        engine.step()
        times[in_place].append(time.perf_counter() - started)
    backend.in_place_decode = True
    gather, kernel = statistics.median(times[False]), statistics.median(times[True])
    for name, step in (("gather", gather), ("kernel", kernel)):
        print(f"{name}: {step * 1e3:8.1f} ms/step, {args.batch / step:7.1f} decode tok/s")
    print(f"kernel / gather: {gather / kernel:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
