"""What tracing costs: the same streaming load against ringserve with tracing off and on, alternated.

    .venv/bin/python bench/tracing_overhead.py --pairs 2 --concurrency 8

Each pair launches `ringserve serve` twice, once plain and once with `--otlp-endpoint` pointing at a local
sink that accepts OTLP/HTTP and discards it (so export work is real, network-free), runs the benchmark's
fixed chat workload at one concurrency, and records output tokens/s and the CPU seconds every ringserve
process spent per generated token (a figure that other load on the machine disturbs less than throughput).
Modes alternate (off, on, off, on, ...) so drift on a shared machine falls on both. Prints the on/off ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import client, server  # noqa: E402
from bench.bench_serving import warn_if_busy  # noqa: E402
from bench.workload import level_conversations  # noqa: E402
from bench.metrics import summarise  # noqa: E402


class OtlpSink:
    """Answers every `POST /v1/traces` with an empty (valid) protobuf response and counts the bytes."""

    def __init__(self) -> None:
        self.requests = 0
        self.bytes = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                length = int(self.headers.get("content-length", 0))
                self.rfile.read(length)
                sink.requests += 1
                sink.bytes += length
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"


def cpu_seconds(pid: int) -> dict[str, float]:
    """User+system CPU seconds of a process and each of its descendants, by command line tail."""
    out: dict[str, float] = {}
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            times = proc.cpu_times()
            name = " ".join(proc.cmdline()[1:4]) or proc.name()
        except psutil.Error:
            continue
        out[f"{proc.pid} {name}"] = times.user + times.system
    return out


def one_run(args: argparse.Namespace, traced: bool, sink: OtlpSink) -> dict[str, Any]:
    server_args = args.server_args + (f" --otlp-endpoint {sink.url}" if traced else "")
    launched = server.launch(args.model, server_args)
    try:
        cfg = client.ClientConfig(launched.base_url, server.served_model(launched.base_url), args.max_tokens,
                                  "chat", ignore_eos=True)
        asyncio.run(client.single(cfg, [{"role": "user", "content": "Say hello."}], 8))
        convs = level_conversations(args.num_prompts, "")
        server.flush_cache(launched.base_url)
        before = cpu_seconds(launched.proc.pid)
        results, wall = asyncio.run(client.run_concurrency(cfg, convs, args.concurrency))
        after = cpu_seconds(launched.proc.pid)
    finally:
        launched.stop()
    summary = summarise("concurrency", args.concurrency, results, wall)
    tokens = sum(r.completion_tokens for r in results if r.ok)
    cpu = sum(after[k] - before.get(k, 0.0) for k in after)
    row = {"tracing": traced, "tok_s": summary.output_tok_s, "tokens": tokens,
           "cpu_ms_per_token": 1e3 * cpu / max(tokens, 1), "errors": summary.errors}
    print(f"  tracing {'on ' if traced else 'off'}: {row['tok_s']:.1f} tok/s, "
          f"{row['cpu_ms_per_token']:.2f} CPU ms per token" + (f", errors {row['errors']}" if row["errors"] else ""),
          flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--server-args", default="", help="extra flags for both servers")
    parser.add_argument("--pairs", type=int, default=2, help="off/on pairs to run (default: 2)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--output-json", default="")
    args = parser.parse_args(argv)
    warn_if_busy("before the runs")
    sink = OtlpSink()
    rows = []
    for _ in range(args.pairs):
        for traced in (False, True):
            rows.append(one_run(args, traced, sink))
    off = [r for r in rows if not r["tracing"]]
    on = [r for r in rows if r["tracing"]]
    tput = statistics.mean(r["tok_s"] for r in on) / statistics.mean(r["tok_s"] for r in off)
    cpu = (statistics.mean(r["cpu_ms_per_token"] for r in on) / statistics.mean(r["cpu_ms_per_token"] for r in off))
    print(f"tracing on / off: throughput {tput:.3f}x ({(1 - tput) * 100:+.1f}% cost), CPU per token {cpu:.3f}x; "
          f"the sink received {sink.requests} OTLP exports ({sink.bytes / 1e3:.0f} kB)")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"runs": rows, "throughput_ratio": tput, "cpu_ratio": cpu},
                                                     indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
