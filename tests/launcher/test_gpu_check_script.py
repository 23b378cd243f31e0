"""The GPU check's bookkeeping without a GPU (bench/gpu_check.py, bench/gpu_check_budget.py, gpu_check.sh):
rows reach the disk as each piece is measured, a piece whose estimated cost exceeds the time left is recorded
as skipped and not run, a sticky CUDA error ends its process, and a failing or hanging child process becomes a
row while the later backends still run. Measurements are fakes that advance a fake clock."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import gpu_check
from bench.gpu_check_budget import (SKIPPED_BUDGET, SKIPPED_STICKY, Budget, Piece, ResultLog, render_table,
                                    run_children, run_pieces)

ROOT = Path(__file__).resolve().parents[2]


class FakeClock:
    """Seconds that pass only when a fake measurement says so."""

    def __init__(self) -> None:
        self.t = 1000.0

    def now(self) -> float:
        return self.t


def disk_rows(log: ResultLog) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The rows as the .jsonl file and as the summary JSON hold them now."""
    lines = [json.loads(x) for x in log.jsonl_path.read_text().splitlines()]
    return lines, json.loads(log.json_path.read_text())["rows"]


def test_each_row_is_on_disk_before_the_next_piece_runs(tmp_path: Path) -> None:
    clock = FakeClock()
    log = ResultLog(tmp_path / "r.json", fresh=True)
    seen: list[int] = []

    def measure(i: int) -> dict[str, Any]:
        lines, summary = disk_rows(log)  # what a kill right now would leave behind
        assert [r["bs"] for r in lines] == list(range(i)) == [r["bs"] for r in summary]
        assert all(r["status"] == "ok" and "tok_s" in r for r in lines)
        seen.append(i)
        clock.t += 2.0
        return {"tok_s": 100.0 * (i + 1)}

    pieces = [Piece({"kind": "speed", "model": "m", "backend": "triton", "bs": i}, 2.0,
                    lambda i=i: measure(i)) for i in range(4)]
    assert run_pieces(pieces, Budget(clock.t + 100, clock=clock.now), log, {"phase": "core"}) == 0
    assert seen == [0, 1, 2, 3]
    lines, summary = disk_rows(log)
    assert [r["seconds"] for r in lines] == [2.0] * 4 and len(summary) == 4
    assert "triton" in log.table_path.read_text()


def test_a_piece_that_would_overrun_is_skipped_not_run(tmp_path: Path) -> None:
    clock = FakeClock()
    log = ResultLog(tmp_path / "r.json", fresh=True)
    ran: list[str] = []

    def piece(name: str, guess: float, takes: float) -> Piece:
        def run() -> dict[str, Any]:
            ran.append(name)
            clock.t += takes
            return {"tok_s": 1.0}
        return Piece({"kind": "speed", "backend": name}, guess, run)

    # each piece takes 3x its guess: after the first, estimates are 3 x guess x margin
    pieces = [piece("a", 1, 3), piece("b", 1, 3), piece("c", 1, 3), piece("d", 1, 3), piece("e", 0.2, 0.6)]
    budget = Budget(clock.t + 10, clock=clock.now)
    run_pieces(pieces, budget, log)
    assert ran == ["a", "b", "c", "e"]  # d (estimate 3.45 s) did not fit the 1 s left; e (0.69 s) did
    rows = {r["backend"]: r for r in disk_rows(log)[0]}
    assert rows["d"]["status"] == SKIPPED_BUDGET and rows["d"]["estimate"] > rows["d"]["left"]
    assert "tok_s" not in rows["d"] and rows["e"]["status"] == "ok"
    assert budget.remaining() >= 0
    assert f"{SKIPPED_BUDGET}: " in log.table_path.read_text()


def test_estimates_carry_over_from_an_earlier_process(tmp_path: Path) -> None:
    log = ResultLog(tmp_path / "r.json", fresh=True)
    log.add({"kind": "speed", "status": "ok", "guess": 2.0, "seconds": 8.0})
    log.add({"kind": "meta", "status": "ok", "guess": 5.0, "seconds": 0.5})
    budget = Budget(0.0, history=log.rows(), margin=1.0)
    assert budget.estimate("speed", 3.0) == 12.0
    assert budget.estimate("equality", 1.0) == 4.0  # no equality ran yet: other kinds' ratio, not the meta's


def test_a_line_cut_short_by_a_kill_loses_only_itself(tmp_path: Path) -> None:
    log = ResultLog(tmp_path / "r.json", fresh=True)
    log.add({"kind": "speed", "bs": 1, "status": "ok"})
    with open(log.jsonl_path, "a") as f:
        f.write('{"kind": "speed", "bs": 2, "sta')  # the process died mid-write
    log.add({"kind": "speed", "bs": 3, "status": "ok"})
    assert [r["bs"] for r in log.rows()] == [1, 3]
    assert [r["bs"] for r in json.loads(log.json_path.read_text())["rows"]] == [1, 3]


def test_a_sticky_cuda_error_ends_the_process_and_records_the_rest(tmp_path: Path) -> None:
    clock = FakeClock()
    log = ResultLog(tmp_path / "r.json", fresh=True)
    ran: list[int] = []

    def run(i: int) -> dict[str, Any]:
        ran.append(i)
        if i == 1:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return {"tok_s": 1.0}

    pieces = [Piece({"kind": "speed", "bs": i}, 1.0, lambda i=i: run(i)) for i in range(4)]
    assert run_pieces(pieces, Budget(clock.t + 100, clock=clock.now), log) == 1
    assert ran == [0, 1]
    assert [r["status"] for r in disk_rows(log)[0]] == ["ok", "error", SKIPPED_STICKY, SKIPPED_STICKY]


def test_a_failing_child_is_recorded_and_later_backends_still_run(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    args = gpu_check.parse_args(["--backends", "bad,good", "--phases", "core,rest", "--out", str(out),
                                 "--time-budget", "60", "--min-child-seconds", "1"])
    commands: list[tuple[str, str, float]] = []

    def fake_child(job: dict[str, Any], deadline: float) -> list[str]:
        commands.append((job["phase"], job["backend"], deadline))
        if job["backend"] == "bad":
            code = "import sys; print('Traceback: CUDA error: boom', file=sys.stderr); sys.exit(3)"
        else:  # a child writes its own rows, appending to the driver's .jsonl
            row = json.dumps({"kind": "speed", "backend": "good", "phase": job["phase"], "status": "ok"})
            code = f"open({str(out.with_suffix('.jsonl'))!r}, 'a').write({row!r} + '\\n')"
        return [sys.executable, "-c", code]

    assert gpu_check.drive(args, command_for=fake_child) == 1
    assert [(p, b) for p, b, _ in commands] == [("core", "bad"), ("core", "good"), ("rest", "bad"), ("rest", "good")]
    assert all(d <= time.time() + 60 for _, _, d in commands)
    rows = json.loads(out.read_text())["rows"]
    children = [(r["phase"], r["backend"], r["status"]) for r in rows if r["kind"] == "child"]
    assert children == [("core", "bad", "failed: exit 3"), ("core", "good", "ok"),
                        ("rest", "bad", "failed: exit 3"), ("rest", "good", "ok")]
    bad = next(r for r in rows if r["kind"] == "child" and r["backend"] == "bad")
    assert bad["exit_code"] == 3 and any("CUDA error: boom" in ln for ln in bad["stderr_tail"])
    assert [r["phase"] for r in rows if r["kind"] == "speed"] == ["core", "rest"]
    assert "failed: exit 3" in out.with_suffix(".txt").read_text()


def test_a_hanging_child_is_stopped_at_its_deadline(tmp_path: Path) -> None:
    log = ResultLog(tmp_path / "r.json", fresh=True)
    budget = Budget(time.time() + 1.5)
    jobs = [{"phase": "core", "backend": "hang"}, {"phase": "core", "backend": "late"}]
    start = time.time()
    run_children(jobs, lambda job, deadline: [sys.executable, "-c", "import time; time.sleep(60)"], log, budget,
                 min_seconds=0.5, grace=0.5)
    assert time.time() - start < 8
    statuses = [r["status"] for r in log.rows()]
    assert statuses[0] == "failed: killed at the deadline" and statuses[1] == SKIPPED_BUDGET


def test_the_plan_puts_the_most_informative_pieces_first() -> None:
    args = gpu_check.parse_args([])
    core = gpu_check.plan("triton", "core", args)
    assert core[0]["kind"] == "equality" and core[0]["model"] == "smollm2-135m"
    assert [(k["bs"], k["graphs"]) for k in core[1:]] == [(1, False), (1, True), (32, False), (32, True)]
    rest = gpu_check.plan("triton", "rest", args)
    speed = {tuple(sorted(k.items())) for k in core[1:] + rest}
    assert len(speed) == len(core) - 1 + len(rest) == 2 * 4 * 3  # models x batch sizes x variants, once each
    assert rest[0]["model"] == "smollm2-135m" and rest[-1]["model"] == "llama-1b"
    assert [k["graphs"] for k in gpu_check.plan("torch", "core", args)[1:]] == [False, False]
    assert [k["bs"] for k in gpu_check.plan(gpu_check.HF, "core", args)] == [1, 32]


def test_the_table_compares_with_transformers_and_the_roofline() -> None:
    rows = [{"kind": "speed", "model": "m", "backend": "triton", "graphs": True, "overlap": True, "bs": 1,
             "status": "ok", "tok_s": 300.0, "roofline_tok_s": 600.0},
            {"kind": "hf", "model": "m", "backend": "transformers", "bs": 1, "status": "ok", "tok_s": 100.0}]
    table = render_table(rows)
    assert re.search(r"triton\+graphs\+overlap\s+1\s+300\s+3\.00x\s+50%", table), table


def test_the_shell_script_parses_and_its_phase_caps_fit_the_default_deadline() -> None:
    script = ROOT / "bench" / "gpu_check.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    caps = [int(c) for c in re.search(r"^CAPS=\(([\d ]+)\)", text, re.M).group(1).split()]
    phases = re.search(r"^PHASES=\(([\w ]+)\)", text, re.M).group(1).split()
    assert len(caps) == len(phases) and sum(caps) <= int(re.search(r"GPU_CHECK_SECONDS:-(\d+)", text).group(1))
    assert re.search(r"FLASHINFER_VERSION:-0\.6\.", text)
