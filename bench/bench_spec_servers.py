"""Speculative decoding through the servers, against llama-server's: one stream, two workloads, one run.

    .venv/bin/python bench/bench_spec_servers.py [--max-tokens 160] [--rounds 2]

Servers, one at a time on the same GGUF (SmolLM2 Q8_0), nothing else running: ringserve `--quantization gguf`
without and with `--speculative-algorithm ngram`; llama-server (bench/build_llama_server.sh) without and with its
draftless speculation (`--spec-type ngram-simple`, then `ngram-map-k`, each at its defaults: the best of them
is its best setting). Each answers the workloads of bench/bench_speculative.py ("quote": answers that copy or
rework their prompt; "prose": open text), one request at a time, greedy, streamed, at most --max-tokens tokens
(stopping where the model ends its answer, the same tokens for all, so rates compare). A warm-up request of each
prompt goes first (ringserve's decode graphs compile then). Prints each server's output tokens per second and
median time to first token per workload, and ratios against ringserve without speculation and llama-server's
best, with the date and CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_moe import cpu_name  # noqa: E402
from bench.bench_speculative import WORKLOADS  # noqa: E402
from bench.client import ClientConfig, single  # noqa: E402
from bench.llama_baseline import launch_llama_server  # noqa: E402
from bench.server import launch, served_model, wait_for_decode_graphs  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
SERVERS = {
    "ringserve": ("ringserve", "--quantization gguf"),
    "ringserve ngram": ("ringserve", "--quantization gguf --speculative-algorithm ngram"),
    "llama-server": ("llama", ""),
    "llama-server ngram-simple": ("llama", "--spec-type ngram-simple"),
    "llama-server ngram-map-k": ("llama", "--spec-type ngram-map-k"),
}


def measure(base_url: str, max_tokens: int, rounds: int) -> dict[str, tuple[float, float]]:
    """Per workload: (output tokens per second over its requests, median TTFT in ms)."""
    cfg = ClientConfig(base_url=base_url, model=served_model(base_url), max_tokens=max_tokens, ignore_eos=False)
    out = {}
    for workload, texts in WORKLOADS.items():
        conversations = [[{"role": "user", "content": text}] for text in texts]
        for messages in conversations:  # warm-up
            asyncio.run(single(cfg, messages, max_tokens))
        wait_for_decode_graphs(base_url, 600)  # ringserve's compiled graphs (nothing on llama-server)
        results = [asyncio.run(single(cfg, m, max_tokens)) for _ in range(rounds) for m in conversations]
        failed = [r.error for r in results if not r.ok]
        if failed:
            raise RuntimeError(f"{workload}: {failed[0]}")
        tokens = sum(r.completion_tokens for r in results)
        out[workload] = (tokens / sum(r.e2e for r in results), 1e3 * statistics.median(r.ttft for r in results))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    figures: dict[str, dict[str, tuple[float, float]]] = {}
    for name, (kind, flags) in SERVERS.items():
        server = (launch(MODEL, flags + " --torch-threads 0") if kind == "ringserve"
                  else launch_llama_server(MODEL, 1, 4096, extra_args=tuple(flags.split())))
        try:
            figures[name] = measure(server.base_url, args.max_tokens, args.rounds)
        finally:
            server.stop()
        print(f"{name}: " + ", ".join(f"{w} {rate:.1f} tok/s, TTFT {ttft:.0f} ms"
                                      for w, (rate, ttft) in figures[name].items()), flush=True)
    print(f"\n{date.today()}  {cpu_name()}  {MODEL} GGUF, one stream, greedy, at most {args.max_tokens} tokens")
    for workload in WORKLOADS:
        best = max((n for n in figures if n.startswith("llama-server")), key=lambda n: figures[n][workload][0])
        base, llama = figures["ringserve"][workload], figures[best][workload]
        spec = figures["ringserve ngram"][workload]
        print(f"{workload}: ringserve ngram {spec[0]:.1f} tok/s = {spec[0] / base[0]:.2f}x ringserve without, "
              f"{spec[0] / llama[0]:.2f}x llama-server's best ({best}, {llama[0]:.1f} tok/s); TTFT "
              f"{spec[1]:.0f} ms = {spec[1] / llama[1]:.2f}x llama-server's")


if __name__ == "__main__":
    main()
