"""The GPU check's measurements, ordered by information per second and never lost: greedy equality of the engine
with transformers on SmolLM2, then decode tok/s at batch 1 and 32 with CUDA graphs off and on (phase `core`),
then the rest: other batch sizes, the overlap loop off, a 1B Llama's shape (phase `rest`), then tensor
parallelism over two GPUs (phase `tp`, bench/tp_bench.py; skipped with a message on a host with one). Each figure sits
next to transformers `generate` on the same GPU and the HBM roofline (`bench/gpu_check_measure.py`).

The driver (the default mode) imports no torch: for each phase, then each backend, it starts a child process
(`--one-backend NAME`), so a sticky CUDA error in one backend leaves the later ones a clean context. A child
checks the time budget before each piece (one model, backend, graphs, overlap and batch size), estimating its
cost from what the pieces before it took, records "skipped: budget" instead of overrunning, and appends each
row as soon as it is measured (`bench/gpu_check_budget.py`): `<out>.jsonl`, with `<out>` (summary JSON) and
`<out>.txt` (the table) rewritten after every row. A child that fails or is killed becomes a row too.
`bench/gpu_check.sh` runs it between the GPU tests.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: make `bench.` importable

from bench.gpu_check_budget import Budget, Piece, ResultLog, Row, render_table, run_children, run_pieces  # noqa: E402

MODEL_NAMES = ("smollm2-135m", "llama-1b")  # the shapes in bench/gpu_check_measure.py's MODELS
EQUALITY_MODEL = "smollm2-135m"
HF = "transformers"  # a pseudo-backend: transformers `generate`, the baseline
TP = "tp2"  # a pseudo-backend: bench/tp_bench.py with tensor parallelism over 2 GPUs (NCCL), against tp=1
PHASES = ("core", "rest", "tp")
CHILD_START = 12.0  # seconds: a fresh process imports torch and transformers, makes a CUDA context, measures
MODEL_COST = {"smollm2-135m": 1.0, "llama-1b": 2.5}  # relative seconds of one piece, for the priors


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (the driver's and a child's)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODEL_NAMES), help=f"comma-separated, from {list(MODEL_NAMES)}")
    p.add_argument("--backends", default=f"triton,flashinfer,torch,{HF}",
                   help=f"attention backends, one child process each (those not installed are recorded as such); "
                        f"torch runs eager only; {HF} is the generate baseline")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, from {list(PHASES)}")
    p.add_argument("--batch-sizes", default="1,8,32,128", help="every batch size measured")
    p.add_argument("--core-batch-sizes", default="1,32", help="those measured first (phase core)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--no-hf", action="store_true", help=f"drop the {HF} baseline from --backends")
    p.add_argument("--out", default="gpu_check.json", help="summary JSON; rows go to .jsonl, the table to .txt")
    p.add_argument("--append", action="store_true", help="add to the rows already in --out's .jsonl")
    p.add_argument("--pytest-log", action="append", default=[], help="a pytest log whose result lines go into "
                                                                      "the summary (repeatable)")
    p.add_argument("--time-budget", type=float, default=330.0, help="seconds for this whole run")
    p.add_argument("--min-child-seconds", type=float, default=20.0,
                   help="a child process is not started with less time than this left")
    p.add_argument("--one-backend", default="", help=argparse.SUPPRESS)  # child mode: this backend only
    p.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)  # child: absolute, epoch s
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.backends = [b for b in args.backends.split(",") if b and not (args.no_hf and b == HF)]
    args.phases = [ph for ph in args.phases.split(",") if ph]
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    args.core_batch_sizes = [int(b) for b in args.core_batch_sizes.split(",") if b]
    for what, given, allowed in (("models", args.models, MODEL_NAMES), ("phases", args.phases, PHASES)):
        if unknown := [x for x in given if x not in allowed]:
            p.error(f"unknown {what} {unknown}; choose from {list(allowed)}")
    return args


def variants(backend: str) -> list[tuple[bool, bool]]:
    """(graphs, overlap) pairs measured for `backend`: eager, graphs with the overlap loop (the CUDA default),
    graphs without it; the torch backend, the reference, eager only."""
    if backend == "torch":
        return [(False, True)]
    return [(False, True), (True, True), (True, False)]


def guess(key: Row) -> float:
    """A prior of a piece's seconds, engine build and graph capture included; `Budget` rescales it by what the
    pieces before it took."""
    scale = MODEL_COST.get(key.get("model", ""), 1.0)
    bs = key.get("bs", 1)
    if key["kind"] == "equality":
        return 30.0
    if key["kind"] == "hf":
        return scale * (3.0 + bs / 64)
    if key["kind"] == "tp":
        return 90.0
    return scale * (4.0 + bs / 32) + (3.0 if key.get("graphs") else 0.0)


def plan(backend: str, phase: str, args: argparse.Namespace) -> list[Row]:
    """The keys of a backend's pieces in one phase, most informative first.

    core: greedy equality on SmolLM2, then the first model at the core batch sizes, eager and with graphs
    (and the overlap loop). rest: everything else of models x batch sizes x variants, core batch sizes of each
    model first, the first model first.
    """
    if (backend == TP) != (phase == "tp"):  # the tp phase is the TP pseudo-backend's only
        return []
    if backend == TP:
        return [{"kind": "tp", "backend": TP}]
    core_bs = [b for b in args.batch_sizes if b in args.core_batch_sizes] or args.batch_sizes[:1]
    keys: list[Row] = []
    if backend == HF:
        for mi, model in enumerate(args.models):
            for bs in sorted(args.batch_sizes, key=lambda b: (b not in core_bs, args.batch_sizes.index(b))):
                is_core = mi == 0 and bs in core_bs
                if is_core == (phase == "core"):
                    keys.append({"kind": "hf", "model": model, "backend": HF, "bs": bs})
        return keys
    core_variants = variants(backend)[:2]
    if phase == "core":
        keys.append({"kind": "equality", "model": EQUALITY_MODEL, "backend": backend, "graphs": True,
                     "overlap": True})
    for mi, model in enumerate(args.models):
        for bs in sorted(args.batch_sizes, key=lambda b: (b not in core_bs, args.batch_sizes.index(b))):
            for graphs, overlap in variants(backend):
                is_core = mi == 0 and bs in core_bs and (graphs, overlap) in core_variants
                if is_core == (phase == "core"):
                    keys.append({"kind": "speed", "model": model, "backend": backend, "graphs": graphs,
                                 "overlap": overlap, "bs": bs})
    return keys


def job_weight(backend: str, phase: str, args: argparse.Namespace) -> float:
    """The prior seconds of one child: start-up and the device check, then its pieces' guesses."""
    return CHILD_START + sum(guess(key) for key in plan(backend, phase, args))


def child_command(args: argparse.Namespace, job: Row, deadline: float) -> list[str]:
    """The command line of the child process that runs `job` (one backend in one phase)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one-backend", job["backend"], "--phases", job["phase"],
           "--deadline", f"{deadline:.3f}", "--out", args.out, "--models", ",".join(args.models),
           "--batch-sizes", ",".join(map(str, args.batch_sizes)),
           "--core-batch-sizes", ",".join(map(str, args.core_batch_sizes)), "--prompt-len", str(args.prompt_len),
           "--warmup", str(args.warmup), "--steps", str(args.steps), "--dtype", args.dtype]
    for log in args.pytest_log:
        cmd += ["--pytest-log", log]
    return cmd


def drive(args: argparse.Namespace, command_for: Callable[[Row, float], list[str]] | None = None,
          clock: Callable[[], float] = time.time) -> int:
    """The driver: one child per (phase, backend), phase by phase; 1 if any child failed, else 0."""
    log = ResultLog(args.out, args.pytest_log, fresh=not args.append)
    budget = Budget(clock() + args.time_budget, clock=clock)
    jobs = [{"phase": phase, "backend": backend, "weight": round(job_weight(backend, phase, args), 1)}
            for phase in args.phases for backend in ([TP] if phase == "tp" else args.backends)]
    failed = run_children(jobs, command_for or (lambda job, deadline: child_command(args, job, deadline)), log,
                          budget, min_seconds=args.min_child_seconds)
    print(render_table(log.rows()), end="")
    print(f"gpu_check.py: {failed} of {len(jobs)} child processes failed; rows in {log.jsonl_path}, summary in "
          f"{log.json_path}, table in {log.table_path}")
    return 1 if failed else 0


def child(args: argparse.Namespace) -> int:
    """A child: every piece of one backend in the given phases, each checked against the deadline first."""
    log = ResultLog(args.out, args.pytest_log)
    backend = args.one_backend
    base = {"phase": ",".join(args.phases)}
    budget = Budget(args.deadline, history=log.rows())
    import torch

    if not torch.cuda.is_available():
        log.add({**base, "kind": "meta", "backend": backend, "status": "error", "error": "no CUDA device"})
        return 2
    if backend == TP:
        gpus = torch.cuda.device_count()
        if gpus < 2:
            print(f"gpu_check.py: the TP=2 phase is skipped: this host has {gpus} GPU, it needs 2", flush=True)
            log.add({**base, "kind": "tp", "backend": TP, "status": "skipped: fewer than 2 GPUs", "gpus": gpus})
            return 0
        return run_pieces([Piece({"kind": "tp", "backend": TP}, guess({"kind": "tp"}), tp_run)], budget, log, base)
    from bench.gpu_check_measure import Bench
    from ringserve.kernels.attention import backend_names

    if backend != HF and backend not in backend_names():
        log.add({**base, "kind": "meta", "backend": backend, "status": "skipped: not installed"})
        return 0
    bench = Bench(args)
    pieces = [Piece({"kind": "meta", "backend": backend}, 5.0, bench.meta)]
    for phase in args.phases:
        pieces += [Piece(key, guess(key), lambda key=key: bench.run(key)) for key in plan(backend, phase, args)]
    return run_pieces(pieces, budget, log, base)


def tp_run() -> dict[str, float | bool]:
    """bench/tp_bench.py at tp=1 and tp=2 on two GPUs: decode and prefill step ms, the all-reduce cost, and
    whether the two gave the same greedy tokens (bfloat16 all-reduces round differently: informative only)."""
    import json
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, str(Path(__file__).resolve().parent / "tp_bench.py"), "--device", "cuda",
                        "--tp", "1,2", "--threads", "2", "--json", out.name], check=True, timeout=600)
        figures = json.loads(Path(out.name).read_text())
    row: dict[str, float | bool] = {"tokens_equal": figures["1"]["tokens"] == figures["2"]["tokens"]}
    for tp in ("1", "2"):
        for kind in ("prefill", "decode"):
            for name in ("step_ms", "allreduce_ms"):
                row[f"tp{tp}_{kind}_{name}"] = round(figures[tp][kind][name], 3)
    return row


def main(argv: list[str] | None = None) -> int:
    """Driver or child, by `--one-backend`."""
    args = parse_args(argv)
    return child(args) if args.one_backend else drive(args)


if __name__ == "__main__":
    raise SystemExit(main())
