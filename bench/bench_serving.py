"""Serving benchmark for ringserve or any OpenAI-compatible server (like sglang.bench_serving / vllm bench serve).

    .venv/bin/python bench/bench_serving.py --launch --hf-baseline --engine-baseline \\
        --output-json /tmp/bench.json --plot /tmp/bench.png

Streams a fixed, deterministic set of chat prompts (greedy, `ignore_eos`, exactly --max-tokens new tokens
each) at fixed concurrency levels, or with Poisson arrivals at --request-rate, and prints per level: request
and token throughput and mean/p50/p99 of TTFT, inter-token latency (per streamed chunk), TPOT and e2e.

--launch starts `ringserve serve` itself (--server-args go to it) and stops it after the load runs, before
the in-process baselines, so nothing competes for the cores:
  --hf-baseline      transformers `generate` on the same prompts: static batches of N for level N
                     (one prompt at a time for level 1); prints ringserve/transformers per level;
  --engine-baseline  ringserve's engine in-process (no bus, no HTTP) at level 1 and the largest level; prints
                     HTTP ITL at level 1 against the engine's own decode step time (the ring's overhead).
  --llama-server     llama.cpp's llama-server (bench/build_llama_server.sh) on the same GGUF, same prompts, one
                     parallel slot per request of the largest level; prints ringserve/llama-server per level.
With --passes N all of it runs N times, every other pass with the baselines first and in reverse order
(ringserve, transformers, llama-server; then llama-server, transformers, ringserve), and a last table gives
each pass's ratios and their median: on a host whose speed drifts within minutes, one pass's ratios carry
the drift, and a drift that is steady over a pair of mirrored passes cancels in their ratios.
With --system-prompt-tokens N every prompt shares a ~N-token system prompt, and a probe reports the TTFT of
a request that reuses it from the prefix cache against the first one that had to prefill it.

--compare-dp launches `--dp 1` and then `--dp 2` on --num-prompts requests over --dp-system-prompts shared
system prompts (--system-prompt-tokens each, default 300) and reports throughput and prefix-cache hit rate
of two replicas against one (bench/dp_compare.py):

    .venv/bin/python bench/bench_serving.py --compare-dp --num-prompts 64 --concurrency 8 --max-tokens 16
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: make `bench.` importable
os.environ.setdefault("TQDM_DISABLE", "1")  # no weight-loading progress bars in the report

from bench import client, server  # noqa: E402
from bench.metrics import LevelSummary, format_table, json_safe, render, summarise  # noqa: E402
from bench.llama_baseline import DEFAULT_BINARY as DEFAULT_LLAMA_SERVER  # noqa: E402
from bench.workload import conversation, level_conversations, requests_for_level, system_prompt  # noqa: E402

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = p.add_argument_group("server")
    target.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="OpenAI-compatible server to load (ignored with --launch) (default: %(default)s)")
    target.add_argument("--launch", action="store_true",
                        help="start `ringserve serve --model MODEL` on a free port, stop it when the load is done")
    target.add_argument("--server-args", default="",
                        help='extra flags for the launched server, one string, e.g. "--chunked-prefill-size 256"; '
                             "the engine baseline reads its engine flags from here too")
    target.add_argument("--model", default=DEFAULT_MODEL,
                        help="model to launch and to load for the baselines: as ringserve's --model "
                             "(default: %(default)s)")
    target.add_argument("--launch-timeout", type=float, default=900.0,
                        help="seconds to wait for the launched server (default: %(default)s)")
    target.add_argument("--endpoint", choices=("chat", "completions"), default="chat",
                        help="/v1/chat/completions, or /v1/completions with the messages joined as plain text "
                             "(default: %(default)s)")
    target.add_argument("--no-ignore-eos", action="store_true",
                        help="do not send the non-OpenAI field ignore_eos (for servers that refuse it); "
                             "requests may then stop before --max-tokens")

    load = p.add_argument_group("workload")
    load.add_argument("--concurrency", default="1,4,8,16,32",
                      help="comma-separated concurrency levels (default: %(default)s)")
    load.add_argument("--request-rate", default="",
                      help="comma-separated Poisson request rates (req/s); when given, replaces --concurrency: "
                           "each rate sends --num-prompts requests")
    load.add_argument("--max-concurrency", type=int, default=0,
                      help="with --request-rate: at most this many requests in flight (default: 0 = no limit)")
    load.add_argument("--num-prompts", type=int, default=32,
                      help="prompts in the set; level c sends min(num-prompts, rounds*c) of them, at least c "
                           "(default: %(default)s)")
    load.add_argument("--rounds", type=int, default=4,
                      help="at concurrency c send up to rounds*c requests, so low levels stay short "
                           "(default: %(default)s)")
    load.add_argument("--max-tokens", type=int, default=64,
                      help="new tokens per request, greedy (default: %(default)s)")
    load.add_argument("--system-prompt-tokens", type=int, default=0,
                      help="prepend a shared system prompt of about this many tokens, e.g. 1000 (default: 0 = none)")
    load.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrivals (default: %(default)s)")
    load.add_argument("--compare-dp", action="store_true",
                      help="launch --dp 1, then --dp 2, on --num-prompts requests over --dp-system-prompts shared "
                           "system prompts, at the highest --concurrency level; report throughput and prefix-cache "
                           "hit rate of two replicas against one (no baselines, no --request-rate)")
    load.add_argument("--dp-system-prompts", type=int, default=4,
                      help="with --compare-dp: distinct shared system prompts (default: %(default)s)")

    extra = p.add_argument_group("baselines and output")
    extra.add_argument("--hf-baseline", action="store_true",
                       help="run transformers generate on the same prompts after the server (concurrency mode)")
    extra.add_argument("--engine-baseline", action="store_true",
                       help="run ringserve's engine in-process at level 1 and the largest level (concurrency mode)")
    extra.add_argument("--llama-server", nargs="?", const=str(DEFAULT_LLAMA_SERVER), default="", metavar="PATH",
                       help="also load llama.cpp's llama-server on the same GGUF after ringserve (default binary: "
                            "the one bench/build_llama_server.sh builds)")
    extra.add_argument("--baseline-threads", type=int, default=0,
                       help="torch threads for both baselines (default: 0 = one per core, like the scheduler)")
    extra.add_argument("--passes", type=int, default=1,
                       help="run ringserve and the baselines this many times, every other pass with the baselines "
                            "first (A B / B A), and print each pass's ratios and their median: on a host whose "
                            "speed drifts, one pass's ratios carry the drift (default: %(default)s)")
    extra.add_argument("--output-json", default="", help="write every figure to this JSON file")
    extra.add_argument("--plot", default="", help="write a PNG of throughput and latency per level (needs matplotlib)")
    args = p.parse_args(argv)
    args.rates = [float(r) for r in args.request_rate.split(",") if r.strip()]
    args.levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if not args.levels or min(args.levels) < 1 or any(r <= 0 for r in args.rates):
        p.error("concurrency levels must be >= 1 and request rates > 0")
    if args.compare_dp and (args.rates or args.hf_baseline or args.engine_baseline or args.plot
                            or "--dp" in args.server_args.split()):
        p.error("--compare-dp launches its own servers (with --dp 1 and 2) and runs no baselines, rates or plot")
    if args.passes < 1 or (args.compare_dp and args.passes > 1):
        p.error("--passes must be >= 1 (and 1 with --compare-dp)")
    if args.dp_system_prompts < 1:
        p.error("--dp-system-prompts must be >= 1")
    return args


def machine_info() -> dict[str, Any]:
    """CPU model, core count and 1-minute load average of this machine."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "load_avg_1m": load}


def warn_if_busy(when: str) -> float:
    """Print a warning when other work keeps the cores busy (the figures are then noisy); the load average."""
    load = machine_info()["load_avg_1m"]
    if load > 0.5 * (os.cpu_count() or 1):
        print(f"warning: load average {load:.1f} on {os.cpu_count()} cores {when}; other work is running and "
              "the figures will be noisy (torch thread pools suffer most)", flush=True)
    return load


def run_load(args: argparse.Namespace, base_url: str, system: str) -> tuple[list[LevelSummary], dict[str, Any]]:
    """Warm up, probe the shared prefix (if any), then run every level; summaries and the probe's figures."""
    cfg = warm_up(args, base_url, system)
    probe: dict[str, Any] = {}
    if system:
        server.flush_cache(base_url)
        cold = asyncio.run(client.single(cfg, conversation(0, system), 2))
        hot = asyncio.run(client.single(cfg, conversation(1, system), 2))
        probe = {"prompt_tokens": cold.prompt_tokens, "ttft_first_ms": cold.ttft * 1e3,
                 "ttft_reuse_ms": hot.ttft * 1e3, "ratio": hot.ttft / cold.ttft if cold.ttft else math.nan}
        print(f"shared system prompt ({cold.prompt_tokens} prompt tokens): TTFT first {cold.ttft * 1e3:.0f} ms, "
              f"reusing it {hot.ttft * 1e3:.0f} ms ({probe['ratio']:.2f}x)", flush=True)
    return run_levels(args, cfg, system), probe


def warm_up(args: argparse.Namespace, base_url: str, system: str) -> client.ClientConfig:
    """One short request, and with --launch one wave per level and the decode graphs they asked for; the
    client config for the load."""
    cfg = client.ClientConfig(base_url, server.served_model(base_url), args.max_tokens, args.endpoint,
                              ignore_eos=not args.no_ignore_eos)
    warm = asyncio.run(client.single(cfg, [{"role": "user", "content": "Say hello."}], 8))
    if not warm.ok:
        raise RuntimeError(f"warm-up request failed: {warm.error}")
    if args.launch:  # compiled CPU decode graphs: one short wave per level asks for its sizes; wait for them
        for c in args.levels or [1]:
            asyncio.run(client.run_concurrency(cfg, level_conversations(c, system), c))
        started = time.monotonic()
        graphs = server.wait_for_decode_graphs(base_url, args.launch_timeout)
        if graphs:
            print(f"decode graphs after {time.monotonic() - started:.0f} s of compiling: {graphs}", flush=True)
    return cfg


def run_levels(args: argparse.Namespace, cfg: client.ClientConfig, system: str) -> list[LevelSummary]:
    """Every level (concurrency or request rate) of the load, each from a cold prefix cache; their summaries."""
    summaries = []
    plan = [("rate", r, args.num_prompts) for r in args.rates] or [
        ("concurrency", c, requests_for_level(c, args.num_prompts, args.rounds)) for c in args.levels]
    for mode, level, n in plan:
        server.flush_cache(cfg.base_url)  # every level starts with a cold prefix cache (ringserve/SGLang only)
        convs = level_conversations(n, system)
        if mode == "rate":
            results, wall = asyncio.run(client.run_poisson(cfg, convs, level, args.max_concurrency, args.seed))
        else:
            results, wall = asyncio.run(client.run_concurrency(cfg, convs, int(level)))
        summary = summarise(mode, level, results, wall)
        summaries.append(summary)
        print(f"  {mode} {level:g}: {summary.completed}/{n} ok, {summary.output_tok_s:.1f} out tok/s, "
              f"ITL p50 {summary.itl_ms['p50']:.1f} ms, TTFT p50 {summary.ttft_ms['p50']:.0f} ms"
              + (f"  errors: {summary.errors}" if summary.errors else ""), flush=True)
    return summaries


def run_baselines(args: argparse.Namespace, system: str) -> tuple[dict[int, Any], dict[int, Any]]:
    """The engine and transformers baselines, one after the other (each with every core)."""
    engine: dict[int, Any] = {}
    hf: dict[int, Any] = {}
    if args.rates and (args.hf_baseline or args.engine_baseline):
        print("baselines run in concurrency mode only; skipped with --request-rate")
        return engine, hf
    convs = {c: level_conversations(requests_for_level(c, args.num_prompts, args.rounds), system)
             for c in args.levels}
    if args.engine_baseline:
        from bench.engine_baseline import engine_prompts, run_engine_baseline

        print("engine baseline (in-process, no bus):", flush=True)
        picked = {c: convs[c] for c in sorted({1, max(args.levels)})}
        engine = run_engine_baseline(args.model, args.server_args, engine_prompts(args.model, picked),
                                     args.max_tokens, args.baseline_threads)
    if args.hf_baseline:
        from bench.hf_baseline import run_hf_baseline

        print("transformers baseline (static batches):", flush=True)
        hf = run_hf_baseline(args.model, convs, args.max_tokens, args.baseline_threads)
    return engine, hf


def run_llama_server(args: argparse.Namespace, system: str) -> dict[int, Any]:
    """The same load against llama-server on the same GGUF: level -> its summary (as a dict)."""
    from bench.llama_baseline import launch_llama_server

    slot_tokens = args.system_prompt_tokens + args.max_tokens + 512  # the prompt, its template and the output
    print(f"llama-server baseline ({max(args.levels)} slots of {slot_tokens} tokens):", flush=True)
    launched = launch_llama_server(args.model, max(args.levels), slot_tokens, args.baseline_threads,
                                   args.llama_server)
    try:
        summaries, _ = run_load(args, launched.base_url, system)
    finally:
        launched.stop()
    return {int(s.level): s.to_dict() for s in summaries}


def comparison(summaries: list[LevelSummary], engine: dict[int, Any], hf: dict[int, Any],
               llama: dict[int, Any] | None = None) -> tuple[str, dict]:
    """The ratio table (ringserve against the baselines) and the ring-overhead figures."""
    llama = llama or {}
    rows = [["concurrency", "ringserve tok/s", "transformers tok/s", "ringserve/transformers", "engine tok/s",
             "ringserve/engine", "llama-server tok/s", "ringserve/llama-server"]]
    for s in summaries:
        c = int(s.level)
        h, e = hf.get(c, {}).get("output_tok_s"), engine.get(c, {}).get("output_tok_s")
        ll = llama.get(c, {}).get("output_tok_s")
        rows.append([str(c), f"{s.output_tok_s:.1f}", f"{h:.1f}" if h else "-",
                     f"{s.output_tok_s / h:.2f}x" if h else "-", f"{e:.1f}" if e else "-",
                     f"{s.output_tok_s / e:.2f}x" if e else "-", f"{ll:.1f}" if ll else "-",
                     f"{s.output_tok_s / ll:.2f}x" if ll else "-"])
    overhead: dict[str, Any] = {}
    one = next((s for s in summaries if s.level == 1), None)
    if one is not None and 1 in engine:
        step = engine[1]["decode_step_ms_p50"]
        overhead = {"http_itl_p50_ms": one.itl_ms["p50"], "engine_step_p50_ms": step,
                    "overhead_ms": one.itl_ms["p50"] - step, "ratio": one.itl_ms["p50"] / step}
    return render(rows), overhead


def serve_and_load(args: argparse.Namespace, system: str) -> tuple[list[LevelSummary], dict[str, Any]]:
    """Launch ringserve (or use --base-url), run every level, stop it: the levels' summaries and the probe."""
    launched = None
    try:
        if args.launch:
            print(f"launching ringserve serve --model {args.model} {args.server_args}".rstrip(), flush=True)
            launched = server.launch(args.model, args.server_args, args.launch_timeout)
            base_url = launched.base_url
        else:
            base_url = args.base_url
            server.wait_ready(base_url, 60)
        print(f"loading {base_url} with {args.max_tokens} new tokens per request", flush=True)
        summaries, probe = run_load(args, base_url, system)
    finally:
        if launched is not None:
            launched.stop()
    print()
    print(format_table(summaries))
    print()
    return summaries, probe


def run_pass(args: argparse.Namespace, system: str, baselines_first: bool) -> dict[str, Any]:
    """One pass: ringserve's load, then transformers (and the engine), then llama-server, or all of it in reverse
    order when `baselines_first`; its figures, with the load average before each part."""
    loads: dict[str, float] = {}
    figures: dict[str, Any] = {"engine": {}, "hf": {}, "llama": {}}

    def ringserve() -> None:
        loads["ringserve"] = warn_if_busy("before ringserve's load")
        figures["summaries"], figures["probe"] = serve_and_load(args, system)

    def transformers_and_engine() -> None:
        if args.hf_baseline or args.engine_baseline:
            loads["transformers"] = warn_if_busy("before the in-process baselines")
        figures["engine"], figures["hf"] = run_baselines(args, system)

    def llama_server() -> None:
        if args.llama_server:
            loads["llama_server"] = warn_if_busy("before llama-server")
            figures["llama"] = run_llama_server(args, system)

    order = [ringserve, transformers_and_engine, llama_server]
    for part in reversed(order) if baselines_first else order:
        part()
    return {**figures, "loads": loads}


def ratio_summary(passes: list[dict[str, Any]]) -> str:
    """Per level, ringserve's output tok/s over each baseline's in every pass, and the median over the passes."""
    rows = [["concurrency", "ringserve/transformers per pass", "median", "ringserve/llama-server per pass",
             "median"]]
    for i, s in enumerate(passes[0]["summaries"]):
        level = int(s.level)
        cells = [str(level)]
        for baseline in ("hf", "llama"):
            ratios = [p["summaries"][i].output_tok_s / p[baseline][level]["output_tok_s"] for p in passes
                      if p[baseline].get(level, {}).get("output_tok_s")]
            cells += [" ".join(f"{r:.2f}x" for r in ratios) or "-",
                      f"{statistics.median(ratios):.2f}x" if ratios else "-"]
        rows.append(cells)
    return render(rows, note="passes alternate the order: ringserve first, then the baselines first")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 when every request succeeded."""
    args = parse_args(argv)
    if args.compare_dp:
        from bench.dp_compare import compare_dp

        report = json_safe({"machine": machine_info(), **compare_dp(args)})
        if args.output_json:
            Path(args.output_json).write_text(json.dumps(report, indent=2))
            print(f"wrote {args.output_json}")
        return 0 if all(run["completed"] == run["requests"] for run in report["runs"]) else 1
    system = system_prompt(args.system_prompt_tokens)
    start_load = machine_info()["load_avg_1m"]  # each part of a pass warns when the machine is busy
    passes = []
    for n in range(args.passes):
        if args.passes > 1:
            print(f"=== pass {n + 1} of {args.passes} ===", flush=True)
        one = run_pass(args, system, baselines_first=n % 2 == 1)
        table, overhead = (comparison(one["summaries"], one["engine"], one["hf"], one["llama"])
                           if (one["engine"] or one["hf"] or one["llama"]) else ("", {}))
        if table:
            print()
            print(table)
        if overhead:
            print(f"ring overhead at batch 1: HTTP ITL p50 {overhead['http_itl_p50_ms']:.1f} ms vs engine decode "
                  f"step p50 {overhead['engine_step_p50_ms']:.1f} ms ({overhead['overhead_ms']:+.1f} ms, "
                  f"{overhead['ratio']:.2f}x)")
        passes.append({**one, "overhead": overhead})
    if args.passes > 1 and (passes[0]["hf"] or passes[0]["llama"]):
        print()
        print(ratio_summary(passes))
    first = passes[0]
    report = {
        "date": datetime.date.today().isoformat(), "machine": machine_info(),
        "config": {k: v for k, v in vars(args).items() if k not in ("levels", "rates")},
        "levels": [s.to_dict() for s in first["summaries"]], "shared_prefix": first["probe"],
        "hf_baseline": {str(k): v for k, v in first["hf"].items()},
        "engine_baseline": {str(k): v for k, v in first["engine"].items()},
        "llama_server": {str(k): v for k, v in first["llama"].items()},
        "ring_overhead": first["overhead"], "load_avg_1m": {"start": start_load, **first["loads"],
                                                            "end": machine_info()["load_avg_1m"]},
        "passes": [{"levels": [s.to_dict() for s in p["summaries"]],
                    "hf_baseline": {str(k): v for k, v in p["hf"].items()},
                    "engine_baseline": {str(k): v for k, v in p["engine"].items()},
                    "llama_server": {str(k): v for k, v in p["llama"].items()}, "load_avg_1m": p["loads"]}
                   for p in passes],
    }
    report = json_safe(report)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.output_json}")
    if args.plot:
        from bench.plot import plot

        try:
            plot(report, args.plot)
            print(f"wrote {args.plot}")
        except ImportError:
            print('no plot: matplotlib is missing (.venv/bin/pip install -e ".[bench]")', file=sys.stderr)
    return 0 if all(s.failed == 0 for p in passes for s in p["summaries"]) else 1

if __name__ == "__main__":
    sys.exit(main())
