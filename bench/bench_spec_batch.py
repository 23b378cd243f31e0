"""Speculation at large batches costs nothing: two engines in one process, speculation off and `ngram`, each
decoding the same N greedy requests of random prompt tokens (no drafts to find), alternated for `--rounds`.

    .venv/bin/python bench/bench_spec_batch.py [--streams 32] [--tokens 48] [--quantization gguf]

Batches of more than 8 decode requests do not speculate (actors/engine/speculative/speculator.py), so the ratio
should be 1.00 at 32 streams. Steps run eagerly in both engines (no compiled graphs: the same code for both).
Prints each round's tokens per second, the engines' verify rows, and the median ratio, with the date and CPU.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_moe import cpu_name  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--prompt-tokens", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quantization", default="gguf")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    from ringserve.actors.common.model_source import resolve_model
    from ringserve.actors.engine.config import EngineConfig
    from ringserve.actors.engine.scheduling.engine_core import EngineCore
    from ringserve.bus.messages import SamplingParams, TokenizedRequest

    torch.set_num_threads(args.threads)
    source = resolve_model("SmolLM2-135M-Instruct")
    engines = {algorithm: EngineCore.from_source(source, EngineConfig(
        device="cpu", quantization=args.quantization, max_total_tokens=16384, torch_threads=args.threads,
        speculative_algorithm=algorithm, disable_cuda_graph=True)) for algorithm in ("none", "ngram")}
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_tokens)] for _ in range(args.streams)]

    def rate(engine: EngineCore, tag: str) -> float:
        for i, prompt in enumerate(prompts):
            engine.add_request(TokenizedRequest(f"{tag}-{i}", prompt, SamplingParams(
                max_new_tokens=args.tokens, temperature=0.0, ignore_eos=True)))
        started = time.perf_counter()
        while engine.has_work():
            engine.step()
        return args.streams * args.tokens / (time.perf_counter() - started)

    rate(engines["none"], "warm-none"), rate(engines["ngram"], "warm-ngram")
    ratios = []
    for r in range(args.rounds):
        order = ["none", "ngram"] if r % 2 == 0 else ["ngram", "none"]
        rates = {algorithm: rate(engines[algorithm], f"{algorithm}-{r}") for algorithm in order}
        ratios.append(rates["ngram"] / rates["none"])
        print(f"round {r}: off {rates['none']:.0f} tok/s, ngram {rates['ngram']:.0f} tok/s: {ratios[-1]:.2f}x",
              flush=True)
    print(f"{date.today()}  {cpu_name()}  torch {torch.__version__}  threads {args.threads}  "
          f"--quantization {args.quantization}  {args.streams} streams x {args.tokens} tokens: median "
          f"{statistics.median(ratios):.2f}x; verify rows with ngram: {engines['ngram'].stats().spec_verify_rows}")


if __name__ == "__main__":
    main()
