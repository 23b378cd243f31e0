"""`--stream-interval` against streaming every token: output throughput and each process's CPU per token.

    .venv/bin/python bench/stream_interval.py --intervals 1,4 --repeats 2 --server-args "--quantization gguf"

Launches `ringserve serve --stream-interval K` for each K of --intervals in turn (the first is the baseline),
--repeats times over, alternating (1, 4, 1, 4, ...) so that a host whose speed drifts treats both alike. Each
launch warms up as `bench_serving.py --launch` does (its decode graphs compiled or loaded before the load),
then runs the same load (--concurrency levels, --num-prompts, --rounds, --max-tokens) and reads the CPU time
(user + system, /proc) every process of the server spent during it: scheduler, detokenizer, entry, tokenizer,
NATS server. Prints per launch the output tokens/s, TPOT p50 and the CPU ms per generated token of each process,
then per K the median throughput against the baseline's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import bench_serving, server  # noqa: E402

ROLES = ("scheduler", "detokenizer", "entry", "tokenizer", "nats-server")
TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            tree[int(stat.rsplit(")", 1)[1].split()[1])].append(int(entry))
    return tree


def _role(pid: int) -> str:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "gone"
    return next((role for role in ROLES if role in cmdline), "launcher")


def cpu_seconds(root: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of every process under `root`, summed per role."""
    tree, seconds = _children(), defaultdict(float)
    todo = [root]
    while todo:
        pid = todo.pop()
        todo.extend(tree.get(pid, []))
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        seconds[_role(pid)] += (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime
    return seconds


def run_one(args: argparse.Namespace, load: argparse.Namespace, interval: int) -> dict:
    """Launch with `--stream-interval interval`, warm up, run the load; its throughput and CPU per token."""
    extra = f"--stream-interval {interval} {args.server_args}".strip()
    print(f"launching ringserve serve --model {args.model} {extra}", flush=True)
    launched = server.launch(args.model, extra, args.launch_timeout)
    try:
        cfg = bench_serving.warm_up(load, launched.base_url, "")
        before = cpu_seconds(launched.proc.pid)
        summaries = bench_serving.run_levels(load, cfg, "")
        after = cpu_seconds(launched.proc.pid)
    finally:
        launched.stop()
    tokens = sum(s.mean_completion_tokens * s.completed for s in summaries)
    cpu_ms = {role: (after[role] - before.get(role, 0.0)) * 1e3 / tokens for role in after if tokens}
    return {"interval": interval, "output_tok_s": [s.output_tok_s for s in summaries],
            "tpot_p50_ms": [s.tpot_ms["p50"] for s in summaries],
            "tokens_per_chunk": [s.tokens_per_chunk for s in summaries], "cpu_ms_per_token": cpu_ms}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--intervals", default="1,4", help="comma-separated --stream-interval values; the first is the "
                                                      "baseline (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=2, help="launches of each interval, alternated (default: 2)")
    p.add_argument("--server-args", default="", help="further flags for every launched server")
    p.add_argument("--model", default=bench_serving.DEFAULT_MODEL, help="as ringserve's --model")
    p.add_argument("--launch-timeout", type=float, default=900.0, help="seconds to wait for each server")
    p.add_argument("--concurrency", default="1", help="comma-separated concurrency levels (default: 1)")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--rounds", type=int, default=4, help="at concurrency c, up to rounds*c requests")
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args(argv)
    intervals = [int(k) for k in args.intervals.split(",") if k.strip()]
    if not intervals or min(intervals) < 1 or args.repeats < 1:
        p.error("intervals must be >= 1 and --repeats >= 1")
    load = bench_serving.parse_args(["--launch", "--concurrency", args.concurrency, "--num-prompts",
                                     str(args.num_prompts), "--rounds", str(args.rounds),
                                     "--max-tokens", str(args.max_tokens)])
    bench_serving.warn_if_busy("before the first launch")
    runs = []
    for _ in range(args.repeats):
        for k in intervals:
            run = run_one(args, load, k)
            runs.append(run)
            cpu = ", ".join(f"{role} {run['cpu_ms_per_token'].get(role, 0.0):.2f}" for role in ROLES)
            print(f"  interval {k}: {', '.join(f'{t:.1f}' for t in run['output_tok_s'])} out tok/s, TPOT p50 "
                  f"{', '.join(f'{t:.1f}' for t in run['tpot_p50_ms'])} ms; CPU ms per token: {cpu}", flush=True)
    print("\n| interval | level | output tok/s (each launch) | median | × interval " f"{intervals[0]} |")
    print("|---|---|---|---|---|")
    for li, level in enumerate(load.levels):
        base = statistics.median(r["output_tok_s"][li] for r in runs if r["interval"] == intervals[0])
        for k in intervals:
            values = [r["output_tok_s"][li] for r in runs if r["interval"] == k]
            med = statistics.median(values)
            print(f"| {k} | {level} | {', '.join(f'{v:.1f}' for v in values)} | {med:.1f} | {med / base:.2f}× |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
