"""The time budget and the result log of the GPU check (`bench/gpu_check.py`); free of torch, so that the CPU
tests can drive it with fake measurements and fake child processes.

- `ResultLog`: every row reaches the disk the moment it exists. It is appended as one JSON line to
  `<out>.jsonl` (flushed and fsynced), then the summary JSON `<out>` and the text table `<out stem>.txt` are
  rewritten from all the lines so far, each through a temporary file and a rename, so a kill at any moment
  leaves the previous complete version. Several processes (the driver and its children, one after another)
  append to the same file.
- `Budget`: before each piece of work, whether its estimated cost fits before the deadline. A piece comes with
  a prior guess of its seconds; the estimate scales that guess by how much longer (or shorter) than their own
  guesses the latest pieces of the same kind took, here or in an earlier process (read back from the log).
- `run_pieces` runs pieces in one process, recording a "skipped: budget" row for each that would not fit;
  `run_children` runs one child process per job (an attention backend in a phase) and records a failed
  child's exit code and last stderr lines as a row, then goes on with the next.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Row = dict[str, Any]
SKIPPED_BUDGET = "skipped: budget"
SKIPPED_STICKY = "skipped: an earlier CUDA error in this process"
STICKY_MARKERS = ("CUDA error", "illegal memory access", "AcceleratorError", "device-side assert",
                  "CUBLAS_STATUS", "cudaError")


@dataclass
class Piece:
    """One unit of work: `key` names it (kind, model, backend, graphs, overlap, bs), `guess` is a prior of
    its seconds, `run` measures it and returns the fields of its row (a "status" other than ok among them)."""

    key: Row
    guess: float
    run: Callable[[], Row]

    @property
    def kind(self) -> str:
        return str(self.key.get("kind", ""))


class Budget:
    """A deadline on `clock` and cost estimates from what earlier pieces took."""

    def __init__(self, deadline: float, clock: Callable[[], float] = time.time, margin: float = 1.15,
                 history: Iterable[Mapping[str, Any]] = ()) -> None:
        self.deadline = deadline
        self.clock = clock
        self.margin = margin
        self._ratios: list[tuple[str, float]] = []  # (kind, seconds / guess), oldest first
        for row in history:
            if row.get("status") in ("ok", "mismatch") and row.get("guess") and row.get("seconds") is not None:
                self.observe(str(row.get("kind", "")), float(row["seconds"]), float(row["guess"]))

    def remaining(self) -> float:
        """Seconds left before the deadline (negative once past it)."""
        return self.deadline - self.clock()

    def observe(self, kind: str, seconds: float, guess: float) -> None:
        """Record that a piece of `kind` guessed at `guess` seconds took `seconds`."""
        if guess > 0:
            self._ratios.append((kind, seconds / guess))

    def estimate(self, kind: str, guess: float) -> float:
        """Expected seconds of a piece: its guess times the largest of the last three ratios of its kind (of
        any kind but the device check when none of its own has run yet; 1 when nothing has), times the safety
        margin."""
        same = [r for k, r in self._ratios if k == kind] or [r for k, r in self._ratios if k != "meta"]
        scale = max(same[-3:]) if same else 1.0
        return guess * scale * self.margin

    def fits(self, kind: str, guess: float) -> tuple[bool, float, float]:
        """(whether the estimate fits the time left, the estimate, the time left)."""
        estimate, left = self.estimate(kind, guess), self.remaining()
        return estimate <= left, estimate, left


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def pytest_summary(paths: Sequence[Path]) -> list[str]:
    """The result lines of pytest logs ("3 passed, 1 failed in 12.3s", "FAILED ...", an interrupt)."""
    found: list[str] = []
    for path in paths:
        try:
            lines = Path(path).read_text(errors="replace").splitlines()
        except OSError:
            continue
        for line in lines:
            s = line.strip().strip("=").strip()
            if s.startswith(("FAILED ", "ERROR ", "KeyboardInterrupt", "Timeout")) or (
                    s.endswith("s") and any(w in s for w in (" passed", " failed", " error", " skipped"))
                    and " in " in s):
                found.append(f"{Path(path).name}: {s}"[:300])
    return found


def label(row: Mapping[str, Any]) -> str:
    """The engine variant of a row: backend, then "+graphs" and "+overlap" where on."""
    graphs, overlap = "+graphs" if row.get("graphs") else "", "+overlap" if row.get("overlap") else ""
    return f"{row.get('backend', '?')}{graphs}{overlap}"


def render_table(rows: Sequence[Row]) -> str:
    """The text report: device line, equality results, the decode speed table, then what did not run."""
    out: list[str] = []
    for meta in [r for r in rows if r.get("kind") == "meta" and r.get("status") == "ok"][:1]:
        out.append(f"{meta.get('gpu')}  torch {meta.get('torch')}  copy bandwidth "
                   f"{meta.get('copy_bandwidth_GBps', 0):,.0f} GB/s  {meta.get('date')}")
    for r in rows:
        if r.get("kind") == "equality" and r.get("status") in ("ok", "mismatch"):
            out.append(f"greedy equality {r.get('model')} {label(r)} {r.get('dtype')}: {r.get('status')}, "
                       f"{r.get('equal')}/{r.get('prompts')} equal, {r.get('near_tie')} near-tie")
    speed = [r for r in rows if r.get("kind") in ("speed", "hf") and r.get("status") == "ok"
             and isinstance(r.get("tok_s"), (int, float))]
    hf = {(r.get("model"), r.get("bs")): r["tok_s"] for r in speed if r.get("kind") == "hf"}
    table = [("model", "engine", "bs", "decode tok/s", "vs HF", "of roofline", "note")]
    for r in sorted(speed, key=lambda r: (str(r.get("model")), int(r.get("bs", 0)), r.get("kind") == "hf")):
        ref, roof = hf.get((r.get("model"), r.get("bs"))), r.get("roofline_tok_s")
        table.append((str(r.get("model")), "transformers" if r.get("kind") == "hf" else label(r), str(r.get("bs")),
                      f"{r['tok_s']:,.0f}", f"{r['tok_s'] / ref:.2f}x" if ref else "-",
                      f"{100 * r['tok_s'] / roof:.0f}%" if roof else "-",
                      "JIT busy" if r.get("jit_in_background") else ""))
    if len(table) > 1:
        widths = [max(len(t[i]) for t in table) for i in range(len(table[0]))]
        out += ["  ".join(c.ljust(w) for c, w in zip(t, widths)).rstrip() for t in table]
    for r in rows:
        status = str(r.get("status", ""))
        if status not in ("ok", "mismatch"):
            what = "/".join(str(r[k]) for k in ("phase", "kind", "model") if r.get(k)) + f"/{label(r)}"
            if r.get("bs"):
                what += f"/bs{r['bs']}"
            detail = r.get("error") or " | ".join(r.get("stderr_tail", [])[-3:])
            out.append(f"{status}: {what}" + (f" ({detail})"[:400] if detail else ""))
    return "\n".join(out) + "\n"


class ResultLog:
    """Rows on disk as they come: `<out>.jsonl` (one line each), `<out>` (summary JSON) and `<out>.txt`."""

    def __init__(self, out: str | Path, pytest_logs: Sequence[str | Path] = (), fresh: bool = False) -> None:
        self.json_path = Path(out)
        self.jsonl_path = self.json_path.with_suffix(".jsonl")
        self.table_path = self.json_path.with_suffix(".txt")
        self.pytest_logs = [Path(p) for p in pytest_logs]
        self.json_path.parent.mkdir(parents=True, exist_ok=True)
        if fresh:
            self.jsonl_path.write_text("")
            self.rewrite()

    def rows(self) -> list[Row]:
        """Every row so far; a line cut short by a kill is left out."""
        try:
            lines = self.jsonl_path.read_text().splitlines()
        except FileNotFoundError:
            return []
        rows = []
        for line in lines:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return rows

    def add(self, row: Row) -> Row:
        """Append `row` (stamped with the time) and rewrite the summary and the table; returns the row."""
        row = {"time": round(time.time(), 3), **row}
        with open(self.jsonl_path, "a+b") as f:
            f.seek(0, os.SEEK_END)
            if f.tell():  # after a line a kill cut short, start a new one rather than extend the broken one
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    f.write(b"\n")
            f.write((json.dumps(row, default=str) + "\n").encode())
            f.flush()
            os.fsync(f.fileno())
        self.rewrite()
        return row

    def rewrite(self) -> None:
        """Rewrite the summary JSON and the table from all rows."""
        rows = self.rows()
        meta = next((r for r in rows if r.get("kind") == "meta" and r.get("status") == "ok"), {})
        summary = {"updated": time.strftime("%Y-%m-%d %H:%M:%S"), "meta": meta,
                   "pytest": pytest_summary(self.pytest_logs), "rows": rows}
        _write_atomic(self.json_path, json.dumps(summary, indent=1, default=str) + "\n")
        try:
            table = render_table(rows)
        except Exception as exc:  # a row the table cannot show must not stop the measurements
            table = f"table unavailable: {exc!r}; the rows are in {self.jsonl_path.name}\n"
        _write_atomic(self.table_path, table)


def is_sticky(exc: BaseException) -> bool:
    """Whether `exc` looks like a CUDA error that poisons the process's context for every later piece."""
    text = f"{type(exc).__name__}: {exc}"
    return any(m in text for m in STICKY_MARKERS)


def run_pieces(pieces: Sequence[Piece], budget: Budget, log: ResultLog, base: Mapping[str, Any] | None = None
               ) -> int:
    """Run each piece that fits the budget, writing its row as soon as it is measured; 1 if a sticky CUDA
    error stopped the run (the later pieces recorded as skipped), else 0."""
    base = dict(base or {})
    for i, piece in enumerate(pieces):
        ok, estimate, left = budget.fits(piece.kind, piece.guess)
        row: Row = {**base, **piece.key, "guess": round(piece.guess, 2), "estimate": round(estimate, 2),
                    "left": round(left, 2)}
        if not ok:
            log.add({**row, "status": SKIPPED_BUDGET})
            continue
        start = budget.clock()
        sticky = False
        try:
            result = dict(piece.run())
        except Exception as exc:  # one piece failing must not hide the others' figures
            sticky = is_sticky(exc)
            result = {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:600]}
        seconds = budget.clock() - start
        status = result.pop("status", "ok")
        if status in ("ok", "mismatch"):
            budget.observe(piece.kind, seconds, piece.guess)
        log.add({**row, **result, "status": status, "seconds": round(seconds, 3)})
        if sticky:
            for later in pieces[i + 1:]:
                log.add({**base, **later.key, "status": SKIPPED_STICKY})
            return 1
    return 0


def _pump(stream: Any, tail: collections.deque[str], echo: Any) -> None:
    for line in stream:
        tail.append(line.rstrip()[-300:])  # progress bars redraw with \r: keep their last state
        echo.write(line)
        echo.flush()


def run_children(jobs: Sequence[Row], command_for: Callable[[Row, float], list[str]], log: ResultLog,
                 budget: Budget, min_seconds: float = 20.0, grace: float = 10.0, tail_lines: int = 20) -> int:
    """Run `command_for(job, deadline)` for each job in its own process, stopping it `grace` seconds past its
    deadline: its share of the time left, by `job["weight"]` (default 1) among the jobs not yet run, and at
    least `min_seconds`; so one slow backend cannot starve the later ones, and what a child leaves unused goes
    to those after it.

    Each child writes its own rows; here one "child" row per job records its exit code, seconds and last
    stderr lines (or "skipped: budget" when under `min_seconds` are left). Returns how many failed.
    """
    failed = 0
    for i, job in enumerate(jobs):
        left = budget.remaining()
        row: Row = {"kind": "child", **job, "left": round(left, 2)}
        if left < min_seconds:
            log.add({**row, "status": SKIPPED_BUDGET})
            continue
        weights = [float(j.get("weight", 1.0)) for j in jobs[i:]]
        share = max(left * weights[0] / sum(weights), min_seconds)
        deadline = budget.clock() + share
        tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        start = budget.clock()
        proc = subprocess.Popen(command_for(job, deadline), stderr=subprocess.PIPE, text=True, errors="replace")
        pump = threading.Thread(target=_pump, args=(proc.stderr, tail, sys.stderr), daemon=True)
        pump.start()
        try:
            code: int | None = proc.wait(timeout=share + grace)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)  # its rows so far are on disk; let it print its traceback
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            code = None
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        pump.join(timeout=5)
        seconds = round(budget.clock() - start, 3)
        if code == 0:
            log.add({**row, "status": "ok", "exit_code": 0, "seconds": seconds})
            continue
        failed += 1
        status = "failed: killed at the deadline" if code is None else f"failed: exit {code}"
        log.add({**row, "status": status, "exit_code": code if code is not None else proc.returncode,
                 "seconds": seconds, "stderr_tail": list(tail)})
    return failed
