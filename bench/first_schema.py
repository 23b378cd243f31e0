"""The first JSON-schema request after a start against the later ones, per server configuration (issue 53).

For each configuration (`--config=FLAGS`, a string of serve flags, written with `=` since it starts with a
dash; repeat it to compare, e.g. `--config=--no-grammar-warm-up --config=`) a `ringserve serve` is started,
timed to its ready line, and sent `--requests` chat requests one after another, each with a schema of its own
(a cache miss: it is compiled), the first at once after ready. Printed per configuration: seconds to ready,
the first request's latency, the median of the later ones, how many log lines say a request waited for its
grammar or a compile worker, and the ring's memory after the requests (PSS of its processes from /proc, and of
its compile workers apart). The figures hold only as ratios between configurations measured in one run on one
host.

`python -m bench.first_schema [--model SmolLM2-135M-Instruct] [--config=FLAGS ...] [--json out.json]`
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from bench.server import launch

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 12},
                                           "score": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["answer", "score"]}


def schema_request(base_url: str, model: str, n: int, max_tokens: int) -> float | str:
    """Seconds for one chat request whose response_format is a schema no earlier request used (its status
    and error, as text, when it failed)."""
    schema = {**SCHEMA, "title": f"bench{n}"}
    body = {"model": model, "messages": [{"role": "user", "content": "Rate the colour blue."}],
            "max_tokens": max_tokens, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": f"s{n}", "schema": schema}}}
    started = time.perf_counter()
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=600)
    seconds = time.perf_counter() - started
    if response.status_code != 200:
        return f"{response.status_code} after {seconds:.1f} s: {response.text[:200]}"
    return seconds


def _pss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def ring_memory(root: int) -> dict[str, float]:
    """PSS in MiB of every process under `root` (the launcher), in total and of the compile workers."""
    parents: dict[int, int] = {}
    commands: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                commands[int(entry)] = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            parents[int(entry)] = int(stat.rpartition(")")[2].split()[1])

    def under(pid: int) -> bool:
        while pid > 1:
            if pid == root:
                return True
            pid = parents.get(pid, 0)
        return False

    ring = [pid for pid in parents if under(pid)]
    workers = [pid for pid in ring if "compile_worker" in commands.get(pid, "")]
    return {"ring_pss_mib": round(sum(map(_pss_mib, ring))), "workers": len(workers),
            "workers_pss_mib": round(sum(map(_pss_mib, workers)))}


def measure(model: str, flags: str, requests: int, max_tokens: int) -> dict[str, Any]:
    """Start a server with `flags`, time its start and its schema requests, stop it."""
    started = time.perf_counter()
    server = launch(model, flags)
    ready_s = time.perf_counter() - started
    try:
        served = httpx.get(f"{server.base_url}/v1/models", timeout=30).json()["data"][0]["id"]
        latencies = [schema_request(server.base_url, served, n, max_tokens) for n in range(requests)]
        memory = ring_memory(server.proc.pid)
        log = server.log_tail(1_000_000)
    finally:
        server.stop()
    later = [x for x in latencies[1:] if isinstance(x, float)]
    return {"flags": flags, "ready_s": round(ready_s, 2), "first_s": _rounded(latencies[0]),
            "later_median_s": round(statistics.median(later), 2) if later else None,
            "latencies_s": [_rounded(x) for x in latencies],
            "grammar_waits": log.count("waited for its grammar") + log.count("waited for a compile worker"),
            **memory}


def _rounded(latency: float | str) -> float | str:
    return round(latency, 2) if isinstance(latency, float) else latency


def main(argv: list[str] | None = None) -> None:
    """Parse flags, measure each configuration in turn, print a table (and write JSON)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--config", action="append", default=None, help="serve flags of one configuration (repeat)")
    p.add_argument("--requests", type=int, default=4, help="schema requests per configuration (each a new schema)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--json", default="", help="write the results here")
    args = p.parse_args(argv)
    results = [measure(args.model, flags, args.requests, args.max_tokens)
               for flags in (args.config if args.config is not None else [""])]
    print(f"{'flags':<28} {'ready s':>8} {'first s':>8} {'later s':>8} {'waits':>6} {'ring MiB':>9} "
          f"{'workers':>8} {'their MiB':>9}")
    for r in results:
        print(f"{r['flags'] or '(default)':<28} {r['ready_s']:>8} {r['first_s']!s:>8.8} {r['later_median_s']!s:>8} "
              f"{r['grammar_waits']:>6} {r['ring_pss_mib']:>9} {r['workers']:>8} {r['workers_pss_mib']:>9}")
    for r in results:
        for latency in r["latencies_s"]:
            if isinstance(latency, str):
                print(f"{r['flags'] or '(default)'}: a request failed: {latency}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=2)


if __name__ == "__main__":
    main()
