"""`bench_serving.py --compare-dp`: one replica against two on a workload of shared system prompts.

Launches `ringserve serve --dp 1`, then `--dp 2` (each with --server-args), and sends both the same requests:
--num-prompts chat requests cycling over --dp-system-prompts distinct system prompts of about
--system-prompt-tokens tokens each (request i uses prompt i mod S, so the prompts interleave), at the highest
--concurrency level, each with a cold prefix cache. Reports per run the output throughput and the prefix-cache
hit rate (cached / prompt tokens, from each response's `usage.prompt_tokens_details.cached_tokens`), and the
ratios of two replicas to one. Cache-aware routing keeps each system prompt on one replica, so the hit rate
with two replicas should stay close to one replica's (random routing would compute each prompt on both).
Timing figures mean little on a loaded machine with fewer cores than replicas; the hit rate does not depend
on timing.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import math
from typing import Any

from bench import client, server
from bench.metrics import RequestResult, summarise
from bench.workload import system_prompt, user_prompt


def conversations(n: int, prompts: int, approx_tokens: int) -> list[list[dict[str, str]]]:
    """n chat requests over `prompts` distinct system prompts (distinct from their first tokens on)."""
    body = system_prompt(approx_tokens)
    systems = [f"You are the assistant of team {k}. {body}" for k in range(prompts)]
    return [[{"role": "system", "content": systems[i % prompts]}, {"role": "user", "content": user_prompt(i)}]
            for i in range(n)]


def hit_rate(results: list[RequestResult]) -> float:
    """Cached prompt tokens over all prompt tokens of the successful requests."""
    done = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in done)
    return sum(r.cached_tokens for r in done) / prompt if prompt else math.nan


def run_one(args: argparse.Namespace, dp: int, convs: list[list[dict[str, str]]]) -> dict[str, Any]:
    """Launch a server with `--dp dp`, send `convs` at the highest concurrency level, stop it; its figures."""
    extra = f"--dp {dp} {args.server_args}".strip()
    print(f"launching ringserve serve --model {args.model} {extra}", flush=True)
    launched = server.launch(args.model, extra, args.launch_timeout)
    try:
        base_url = launched.base_url
        cfg = client.ClientConfig(base_url, server.served_model(base_url), args.max_tokens, args.endpoint,
                                  ignore_eos=not args.no_ignore_eos)
        warm = asyncio.run(client.single(cfg, [{"role": "user", "content": "Say hello."}], 4))
        if not warm.ok:
            raise RuntimeError(f"warm-up request failed: {warm.error}")
        server.flush_cache(base_url)
        level = max(args.levels)
        results, wall = asyncio.run(client.run_concurrency(cfg, convs, level))
    finally:
        launched.stop()
    summary = summarise("concurrency", level, results, wall)
    figures = {"dp": dp, "concurrency": level, "requests": len(convs), "completed": summary.completed,
               "output_tok_s": summary.output_tok_s, "cache_hit_rate": hit_rate(results),
               "mean_prompt_tokens": summary.mean_prompt_tokens, "duration_s": wall, "errors": summary.errors}
    print(f"  dp {dp}: {summary.completed}/{len(convs)} ok, {summary.output_tok_s:.1f} out tok/s, "
          f"prefix-cache hit rate {figures['cache_hit_rate']:.1%}", flush=True)
    return figures


def compare_dp(args: argparse.Namespace) -> dict[str, Any]:
    """Run `--dp 1` then `--dp 2` on the shared-system-prompt workload; the figures and their ratios."""
    convs = conversations(args.num_prompts, args.dp_system_prompts, args.system_prompt_tokens or 300)
    one, two = run_one(args, 1, convs), run_one(args, 2, convs)
    report = {"date": datetime.date.today().isoformat(), "system_prompts": args.dp_system_prompts,
              "runs": [one, two],
              "throughput_ratio": two["output_tok_s"] / one["output_tok_s"] if one["output_tok_s"] else math.nan,
              "hit_rate_ratio": (two["cache_hit_rate"] / one["cache_hit_rate"]
                                 if one["cache_hit_rate"] else math.nan)}
    print()
    print("| replicas | requests | mean prompt tokens | output tok/s | prefix-cache hit rate |")
    print("|---|---|---|---|---|")
    for run in (one, two):
        print(f"| {run['dp']} | {run['completed']}/{run['requests']} | {run['mean_prompt_tokens']:.0f} | "
              f"{run['output_tok_s']:.1f} | {run['cache_hit_rate']:.1%} |")
    print(f"two replicas / one: throughput {report['throughput_ratio']:.2f}x, "
          f"hit rate {report['hit_rate_ratio']:.2f}x")
    return report
