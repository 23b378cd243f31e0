"""Tensor-parallel step time on this host: tp=1/2/3 for a prefill step and a decode step, and what the
all-reduces cost per step.

    .venv/bin/python bench/tp_bench.py --tp 1,2,3 [--device cpu] [--threads 1]

The model is a random-weight Llama of SmolLM2-135M's size (30 layers, hidden 576, MLP 1536, vocab 49152) with
12 heads and 6 KV heads, so 1, 2 and 3 all divide it (SmolLM2's own 9 heads do not split over 2). Each rank is
a process (spawned; gloo on loopback, or NCCL with one GPU per rank on `--device cuda`) with `--threads` torch
threads. Rank 0 runs an ordinary `TPEngine`: one prefill step of `--prompt` tokens, then `--decode-steps` steps
of a `--batch`-request decode batch. Per step it reports the wall time (median), the time rank 0 spent in
all-reduces (2 per layer: the transfer, plus waiting for the slowest rank to reach it) and in the plan
broadcast, and an all-reduce alone at the step's size (median of repeated calls, the pure communication).
Prints a markdown table (and `--json` writes the rows).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
             num_attention_heads=12, num_key_value_heads=6, max_position_embeddings=2048,
             tie_word_embeddings=True, initializer_range=0.02, rope_theta=100000.0)


def _model(device: str) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from ringserve.actors.engine.models.weights import model_from_hf

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**SHAPE)).eval()
    return model_from_hf(hf.config, hf.state_dict(), device)


class _Timer:
    """Seconds spent inside a wrapped function, since the last `take`."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def _requests(args: argparse.Namespace) -> tuple[Any, list[Any]]:
    from ringserve.bus.messages import SamplingParams, TokenizedRequest

    def req(rid: str, n: int, new: int) -> Any:
        return TokenizedRequest(rid, [3 + (7 * i) % 40000 for i in range(n)],
                                SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True))

    prefill = req("prefill", args.prompt, 1)
    decodes = [req(f"d{i}", 16, args.decode_steps + 2) for i in range(args.batch)]
    return prefill, decodes


def _measure(engine: Any, args: argparse.Namespace, reduce_t: _Timer, plan_t: _Timer) -> dict[str, Any]:
    """Rank 0: the prefill step, then the decode steps; per kind the median step and its collective time."""
    prefill, decodes = _requests(args)
    rows: dict[str, list[tuple[float, float, float]]] = {"prefill": [], "decode": []}
    for _ in range(args.repeat):
        assert engine.add_request(prefill) is None
        reduce_t.take(), plan_t.take()
        start = time.perf_counter()
        while engine.has_work():
            engine.step()
        rows["prefill"].append((time.perf_counter() - start, reduce_t.take(), plan_t.take()))
    for req in decodes:
        assert engine.add_request(req) is None
    tokens: dict[str, list[int]] = {}
    while engine.has_work():
        reduce_t.take(), plan_t.take()
        start = time.perf_counter()
        for row in engine.step():
            tokens.setdefault(row.rid, []).extend(row.token_ids)
        plan = engine.last_plan()
        if plan is not None and not plan.prefill and len(plan.decode_rids) == args.batch:
            rows["decode"].append((time.perf_counter() - start, reduce_t.take(), plan_t.take()))
    result: dict[str, Any] = {
        kind: {"step_ms": 1e3 * statistics.median(r[0] for r in got),
               "allreduce_ms": 1e3 * statistics.median(r[1] for r in got),
               "plan_ms": 1e3 * statistics.median(r[2] for r in got), "steps": len(got)}
        for kind, got in rows.items()}
    result["tokens"] = [tokens[f"d{i}"] for i in range(args.batch)]  # greedy: tp sizes should agree
    return result


def _allreduce_alone(group: Any, tokens: int, hidden: int, calls: int) -> float:
    """Median ms of one all-reduce of a `[tokens, hidden]` float32 tensor."""
    import torch

    x = torch.ones((tokens, hidden), device=group.device)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        group.all_reduce(x)
        if x.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _rank(rank: int, tp: int, addr: str, args: argparse.Namespace, queue: Any) -> None:
    import torch

    torch.set_num_threads(args.threads)
    from ringserve.actors.engine.parallel import tensor_parallel
    from ringserve.actors.engine.scheduling import tp_engine
    from ringserve.actors.engine.config import EngineConfig
    from ringserve.actors.engine.scheduling.tp_engine import TPEngine, TPFollower, prepare_rank

    device = f"cuda:{rank}" if args.device == "cuda" else "cpu"
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    group = tensor_parallel.init_group(rank, tp, addr, device, timeout_s=30.0)
    reduce_t, plan_t = _Timer(), _Timer()
    group.all_reduce = reduce_t.wrap(group.all_reduce)  # type: ignore[method-assign]
    tp_engine.broadcast_plan = plan_t.wrap(tp_engine.broadcast_plan)
    tp_engine.broadcast_step_tensors = plan_t.wrap(tp_engine.broadcast_step_tensors)
    model = _model(device)
    config = prepare_rank(model, EngineConfig(device=device, torch_threads=args.threads, max_total_tokens=8192,
                                              chunked_prefill_size=args.prompt, max_prefill_tokens=args.prompt,
                                              disable_radix_cache=True), group)
    try:
        if rank == 0:
            engine = TPEngine(model, config, group)
            result = _measure(engine, args, reduce_t, plan_t)
            engine.close()
        else:
            TPFollower(model, config, group).run()
        alone = {kind: _allreduce_alone(group, n, SHAPE["hidden_size"], 50)
                 for kind, n in (("prefill", args.prompt), ("decode", args.batch))}
        if rank == 0:
            for kind in alone:
                result[kind]["allreduce_alone_ms"] = alone[kind]
            queue.put(result)
    finally:
        tensor_parallel.close_group(group)


def _tp1(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from ringserve.actors.engine.config import EngineConfig
    from ringserve.actors.engine.scheduling.engine_core import EngineCore

    torch.set_num_threads(args.threads)
    device = "cuda:0" if args.device == "cuda" else "cpu"
    engine = EngineCore(_model(device), EngineConfig(device=device, torch_threads=args.threads, max_total_tokens=8192,
                                                 chunked_prefill_size=args.prompt, max_prefill_tokens=args.prompt,
                                                 disable_radix_cache=True, disable_cuda_graph=True))
    result = _measure(engine, args, _Timer(), _Timer())
    for kind in ("prefill", "decode"):
        result[kind]["allreduce_alone_ms"] = 0.0
    return result


def run(tp: int, args: argparse.Namespace) -> dict[str, Any]:
    """One tp setting's figures (tp=1: the plain engine in this process)."""
    if tp == 1:
        return _tp1(args)
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, tp, addr, args, queue)) for r in range(tp)]
    for p in procs:
        p.start()
    try:
        return queue.get(timeout=1800)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


def table(results: dict[int, dict[str, Any]], args: argparse.Namespace) -> str:
    lines = ["| tp | step | step ms | all-reduce ms in step (60 calls) | all-reduce alone, ms per call | "
             "plan broadcast ms |", "|---|---|---|---|---|---|"]
    for tp, result in results.items():
        for kind, label in (("prefill", f"prefill {args.prompt} tokens"), ("decode", f"decode batch {args.batch}")):
            r = result[kind]
            lines.append(f"| {tp} | {label} | {r['step_ms']:.1f} | {r['allreduce_ms']:.1f} | "
                         f"{r['allreduce_alone_ms']:.3f} | {r['plan_ms']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", default="1,2,3", help="comma-separated tensor-parallel sizes")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--prompt", type=int, default=256, help="tokens of the prefill step")
    parser.add_argument("--batch", type=int, default=8, help="requests in the decode batch")
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3, help="prefill steps measured")
    parser.add_argument("--json", default="", help="also write the figures here")
    args = parser.parse_args()
    results = {tp: run(tp, args) for tp in (int(t) for t in args.tp.split(","))}
    print(table(results, args))
    same = all(r["tokens"] == results[min(results)]["tokens"] for r in results.values())
    print(f"greedy tokens of the decode batch equal across tp sizes: {same}")
    if args.json:
        Path(args.json).write_text(json.dumps({str(k): v for k, v in results.items()}, indent=2))


if __name__ == "__main__":
    main()
