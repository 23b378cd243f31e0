"""Tensor parallelism at the engine level: a tiny random Llama (4 heads, 2 KV heads, float32) split over ranks
that are real processes joined by gloo on loopback gives rank 0 the tp=1 engine's logprobs (close) and greedy
tokens (equal), through prefill, chunked prefill, the prefix cache, retraction, speculation and LoRA adapters; a follower that dies or
stops ends rank 0's requests with errors within seconds, and followers exit when rank 0 is gone."""

from __future__ import annotations

import functools
import os
import queue as queue_module
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from ringserve.actors.engine.config import EngineConfig
from ringserve.actors.engine.quantization.quantize import apply_quantization, quantization_report
from ringserve.actors.engine.parallel.tensor_parallel import close_group, init_group
from ringserve.actors.engine.parallel.tp_checks import check_shardable
from ringserve.actors.engine.scheduling.tp_engine import TPEngine, TPFollower, prepare_rank
from ringserve.actors.engine.parallel.tp_plan import FORWARD, ForwardPlan, decode_plan, encode_plan
from ringserve.actors.engine.models.weights import model_from_hf
from ringserve.bus.codec import DecodeError
from ringserve.bus.messages import SamplingParams, TokenizedRequest
from tests.engine_helpers import engine_for, tiny_hf_llama
from tests.model_families import ORIGINAL_CONTEXT, VOCAB, tiny_hf_model

EOS = 2
TIMEOUT_S = 3.0  # every collective's timeout in these tests (the default)
PROCESS_WAIT_S = 240  # spawning ranks imports torch and transformers per process on a loaded machine

Wave = list[tuple]  # (rid, prompt, max_new_tokens[, LoRA adapter: "name", or "name=path" to load it first])


def _prompts(seed: int, lengths: tuple[int, ...], vocab: int = 512) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


@functools.lru_cache(maxsize=1)
def _lora_dir() -> str:
    """Two PEFT adapters ("a", "b") on the tiny Llama, made once per test process in a temporary directory."""
    from tests.models.test_lora import make_adapter

    root = Path(tempfile.mkdtemp(prefix="tp-lora-"))
    for seed, name in enumerate("ab", start=1):
        make_adapter(tiny_hf_llama(), root / name, seed)
    return str(root)


def _scenarios() -> list[tuple[str, dict[str, Any], list[Wave]]]:
    """(name, engine config, waves of requests: each wave runs to completion before the next is added)."""
    plain = _prompts(1, (5, 17, 30, 9))
    shared = [plain[2][:24] + p for p in _prompts(2, (6, 3))]  # 24 tokens of r2's prompt: a prefix-cache hit
    chunked = _prompts(3, (37, 5, 23))
    retract = _prompts(4, (1, 5, 9, 17, 12))
    # Phi-3's longrope: one prompt crosses the original context while decoding (rank 0 encodes it again), one
    # already in its chunked prefill (each row's rope floor reaches the followers in the plan)
    longrope = _prompts(5, (ORIGINAL_CONTEXT - 4, ORIGINAL_CONTEXT + 5, 6), vocab=VOCAB)
    return [
        ("plain", {}, [[(f"p{i}", p, 10) for i, p in enumerate(plain)],
                       [(f"s{i}", p, 8) for i, p in enumerate(shared)]]),
        ("chunked", {"chunked_prefill_size": 8, "max_prefill_tokens": 8},
         [[(f"c{i}", p, 8) for i, p in enumerate(chunked)]]),
        ("retract", {"max_total_tokens": 48}, [[(f"r{i}", p, 12) for i, p in enumerate(retract)]]),
        ("longrope", {"model": "phi3", "chunked_prefill_size": 8}, [[(f"f{i}", p, 12) for i, p in enumerate(longrope)]]),
        ("int8", {"quantization": "int8"}, [[(f"q{i}", p, 8) for i, p in enumerate(plain)]]),
        # verify steps: a request's draft rows on its table row, laid out for the followers as any decode rows
        ("speculative", {"speculative_algorithm": "ngram"}, [[(f"n{i}", p * 3, 24) for i, p in enumerate(plain)]]),
        # a draft model runs whole on rank 0 and drafts for the group: the served model's own weights, so the
        # sharded verify must accept nearly every draft
        ("draft", {"speculative_algorithm": "draft", "speculative_draft_model_path": "(in process)"},
         [[(f"d{i}", p * 3, 24) for i, p in enumerate(plain)]]),
        # each rank keeps its slice of the adapters; "b", loaded on rank 0 at run time, reaches the follower
        # with the first step that uses it
        ("lora", {"lora_modules": f"a={_lora_dir()}/a", "max_loras_per_batch": 2},
         [[("l0", plain[0], 8, "a"), ("l1", plain[1], 8, None), ("l2", chunked[0], 8, "a")],
          [("l3", plain[0], 8, f"b={_lora_dir()}/b"), ("l4", plain[2], 8, "a"), ("l5", plain[3], 8)]]),
    ]


def _draft_for(config: dict[str, Any]) -> Any:
    """The draft model's engine for a `speculative_algorithm="draft"` scenario's `config` (seeded: the same in
    every process), whole: the one rank 0 runs beside its shard."""
    if config.get("speculative_algorithm") != "draft":
        return None
    return engine_for(tiny_hf_llama(), max_total_tokens=4096)


def _run_waves(engine: Any, waves: list[Wave]) -> dict[str, Any]:
    """Each request's tokens, logprobs, top-3 logprobs and cached tokens, and the engine's retraction count."""
    out: dict[str, Any] = {}
    for wave in waves:
        for rid, prompt, n, *lora in wave:
            name = lora[0] if lora else None
            if name is not None and "=" in name:
                name, path = name.split("=", 1)
                assert engine.load_lora(name, path) is None
            params = SamplingParams(max_new_tokens=n, temperature=0.0, stop_token_ids=[EOS], return_logprob=True,
                                    top_logprobs_num=3, lora_name=name)
            assert engine.add_request(TokenizedRequest(rid, prompt, params)) is None
        while engine.has_work():
            for row in engine.step():
                assert row.finish is None or row.finish.type in ("stop", "length"), row.finish
                got = out.setdefault(row.rid, {"tokens": [], "logprobs": [], "top": [], "cached": row.cached_tokens})
                got["tokens"] += row.token_ids
                got["logprobs"] += row.logprobs or []
                got["top"] += row.top_logprobs or []
            engine.check_integrity()
    return {"requests": out, "retractions": engine.counters.num_retractions,
            "quantization": engine.stats().quantization.get("method", "none"),
            "spec_accepted": engine.stats().spec_accepted_tokens}


def _free_addr() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _rank_main(rank: int, size: int, addr: str, scenarios: list[Any], queue: Any, kill: str = "",
               peer_pid: int = 0) -> None:
    """One rank: every scenario in turn (rank 0 runs its requests; followers run rank 0's plans). With `kill`
    (rank 0 only): SIGKILL or SIGSTOP the follower `peer_pid` mid-generation and report how the requests end."""
    torch.set_num_threads(1)
    group = None
    try:
        group = init_group(rank, size, addr, "cpu", timeout_s=TIMEOUT_S)
        results: dict[str, Any] = {}
        for name, config_kwargs, waves in scenarios:
            # seeded: the same weights in every process; "model" names a tiny family (tests/model_families.py)
            config_kwargs = dict(config_kwargs)
            family, expert_parallel = config_kwargs.pop("model", None), config_kwargs.pop("expert_parallel", False)
            hf = tiny_hf_model(family) if family else tiny_hf_llama()
            model = model_from_hf(hf.config, hf.state_dict(), "cpu")
            config = prepare_rank(model, EngineConfig(device="cpu", torch_threads=1, **config_kwargs), group,
                                  expert_parallel)
            if rank != 0:
                follower = TPFollower(model, config, group)
                follower.run()
                results[name] = follower.steps
            elif kill:
                results[name] = _kill_follower(TPEngine(model, config, group), waves, kill, peer_pid)
            else:
                engine = TPEngine(model, config, group, draft=_draft_for(config_kwargs))
                results[name] = _run_waves(engine, waves)
                engine.close()
        queue.put((rank, results))
    except BaseException as exc:  # the test reads what went wrong
        queue.put((rank, f"error: {exc!r}"))
        sys.exit(1)
    finally:
        close_group(group)


def _kill_follower(engine: TPEngine, waves: list[Wave], how: str, pid: int) -> dict[str, Any]:
    for rid, prompt, n in waves[0]:
        params = SamplingParams(max_new_tokens=n, temperature=0.0)
        assert engine.add_request(TokenizedRequest(rid, prompt, params)) is None
    for _ in range(3):
        engine.step()
    os.kill(pid, getattr(signal, how))
    killed_at = time.monotonic()
    errors: dict[str, str] = {}
    while engine.has_work() and len(errors) < len(waves[0]):
        for row in engine.step():
            if row.finish is not None:
                assert row.finish.type == "error", row.finish
                errors[row.rid] = row.finish.error.message
    elapsed = time.monotonic() - killed_at
    try:
        engine.step()
        raised = ""
    except Exception as exc:
        raised = repr(exc)
    refused = engine.add_request(TokenizedRequest("late", [5, 6], SamplingParams(max_new_tokens=2)))
    if how == "SIGSTOP":
        os.kill(pid, signal.SIGKILL)
    return {"elapsed": elapsed, "errors": errors, "raised": raised, "refused": refused.message if refused else ""}


def _spawn_group(size: int, scenarios: list[Any], kill: str = "") -> tuple[dict[int, Any], list[Any]]:
    """Run `size` ranks on `scenarios`; each rank's results (or its error string) and the processes. Each rank
    reports on a queue of its own: a rank killed while holding a shared queue's lock would wedge the others'."""
    ctx = mp.get_context("spawn")
    queues = [ctx.Queue() for _ in range(size)]
    addr = _free_addr()
    followers = [ctx.Process(target=_rank_main, args=(r, size, addr, scenarios, queues[r])) for r in range(1, size)]
    for p in followers:
        p.start()
    leader = ctx.Process(target=_rank_main, args=(0, size, addr, scenarios, queues[0], kill,
                                                  followers[0].pid if kill else 0))
    leader.start()
    procs = [leader, *followers]
    results: dict[int, Any] = {}
    deadline = time.monotonic() + PROCESS_WAIT_S
    try:
        while len(results) < size and time.monotonic() < deadline:
            for r, (p, q) in enumerate(zip(procs, queues)):
                if r in results:
                    continue
                try:
                    results[r] = q.get(timeout=0.2)[1]
                except queue_module.Empty:
                    if not p.is_alive():
                        try:  # what it put just before exiting
                            results[r] = q.get(timeout=1)[1]
                        except queue_module.Empty:
                            results[r] = f"exited with {p.exitcode} and no report"
    finally:
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
                p.join()
    return results, procs


def _check_close(tp1: dict[str, Any], tpn: dict[str, Any], atol: float = 1e-4) -> None:
    assert tpn["requests"].keys() == tp1["requests"].keys()
    assert tpn["quantization"] == tp1["quantization"]
    for rid, want in tp1["requests"].items():
        got = tpn["requests"][rid]
        assert got["tokens"] == want["tokens"], rid
        assert len(got["logprobs"]) == len(got["tokens"]) and len(got["top"]) == len(got["tokens"]), rid
        assert got["cached"] == want["cached"], rid
        torch.testing.assert_close(torch.tensor(got["logprobs"]), torch.tensor(want["logprobs"]), atol=atol, rtol=0)
        torch.testing.assert_close(torch.tensor(got["top"]), torch.tensor(want["top"]), atol=atol, rtol=0)
    assert tpn["retractions"] == tp1["retractions"]


@pytest.fixture(scope="module")
def tp1_results() -> dict[str, Any]:
    out = {}
    for name, config, waves in _scenarios():
        config = dict(config)
        family = config.pop("model", None)
        engine = engine_for(tiny_hf_model(family) if family else tiny_hf_llama(), draft=_draft_for(config), **config)
        apply_quantization(engine.runner.model, engine.config)  # what EngineCore.from_source does after loading
        engine.startup.quantization = quantization_report(engine.runner.model)
        out[name] = _run_waves(engine, waves)
    return out


def test_tp2_matches_tp1_through_prefill_chunking_prefix_cache_and_retraction(
        tp1_results: dict[str, Any]) -> None:
    results, procs = _spawn_group(2, _scenarios())
    assert isinstance(results.get(0), dict) and isinstance(results.get(1), dict), results
    for name, _, _ in _scenarios():
        if name != "int8":
            _check_close(tp1_results[name], results[0][name])
        assert results[1][name] > 0  # the follower ran the forwards
    # int8: each rank quantizes its shard (the same groups of 32 as the whole weight), but which kernel each
    # shape runs is measured at start-up (float32 where no int8 kernel is faster), so a shard may round
    # differently from the whole: the prefill's token and logprob agree, later tokens may fork at near-ties
    assert results[0]["int8"]["quantization"] == "int8"
    for rid, want in tp1_results["int8"]["requests"].items():
        got = results[0]["int8"]["requests"][rid]
        assert got["tokens"][0] == want["tokens"][0] and abs(got["logprobs"][0] - want["logprobs"][0]) < 5e-2, rid
    assert results[0]["plain"]["requests"]["s0"]["cached"] >= 24  # the prefix cache served the second wave
    assert results[0]["retract"]["retractions"] > 0
    assert results[0]["speculative"]["spec_accepted"] > 0
    assert results[0]["draft"]["spec_accepted"] > 50  # the whole model's drafts, verified over both ranks
    lora = results[0]["lora"]["requests"]
    assert lora["l0"]["tokens"] != lora["l3"]["tokens"]  # the two adapters differ on one prompt (and the
    # tp=1 engine, compared above, matches PEFT's tokens: tests/models/test_lora.py)
    assert all(p.exitcode == 0 for p in procs)


def test_tp4_replicates_the_kv_heads(tp1_results: dict[str, Any]) -> None:
    """4 ranks over 2 KV heads: each KV head is kept by two ranks (one query head each)."""
    scenario = _scenarios()[:1]
    results, procs = _spawn_group(4, scenario)
    assert all(isinstance(results.get(r), dict) for r in range(4)), results
    _check_close(tp1_results["plain"], results[0]["plain"])
    assert all(p.exitcode == 0 for p in procs)


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_a_follower_that_dies_or_stops_ends_the_requests_with_errors(how: str) -> None:
    waves = [[(f"k{i}", p, 200) for i, p in enumerate(_prompts(5, (7, 12)))]]
    results, procs = _spawn_group(2, [("kill", {"max_total_tokens": 512}, waves)], kill=how)
    report = results.get(0)
    assert isinstance(report, dict), results
    got = report["kill"]
    assert set(got["errors"]) == {"k0", "k1"}
    assert all("tensor-parallel" in message for message in got["errors"].values()), got["errors"]
    assert got["elapsed"] < 5.0
    assert "TPGroupError" in got["raised"]
    assert "tensor-parallel replica failed" in got["refused"]
    assert not any(p.is_alive() for p in procs)


def test_followers_exit_when_rank0_is_gone() -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    addr = _free_addr()
    scenario = [("idle", {}, [[("x", [5, 6, 7], 2)]])]
    follower = ctx.Process(target=_rank_main, args=(1, 2, addr, scenario, queue))
    follower.start()
    # rank 0 joins the group and builds its engine, then is killed while idle (its own queue: a process killed
    # while it holds a queue's lock would wedge the follower's)
    ready = ctx.Queue()
    leader = ctx.Process(target=_idle_leader, args=(addr, ready))
    leader.start()
    try:
        assert ready.get(timeout=PROCESS_WAIT_S) == "leader ready"
        leader.kill()
        leader.join()
        rank, said = queue.get(timeout=3 * TIMEOUT_S)  # the follower's collective fails: it reports, exits
        assert rank == 1 and "TPGroupError" in said, said
        follower.join(timeout=60)
        assert not follower.is_alive(), "the follower still runs with its rank 0 gone"
        assert follower.exitcode == 1
    finally:
        for p in (leader, follower):
            if p.is_alive():
                p.kill()
                p.join()


def _idle_leader(addr: str, queue: Any) -> None:
    torch.set_num_threads(1)
    group = init_group(0, 2, addr, "cpu", timeout_s=TIMEOUT_S)
    hf = tiny_hf_llama()
    model = model_from_hf(hf.config, hf.state_dict(), "cpu")
    TPEngine(model, prepare_rank(model, EngineConfig(device="cpu", torch_threads=1), group), group)
    queue.put("leader ready")
    time.sleep(600)


def test_unshardable_models_are_refused_with_the_reason() -> None:
    config = tiny_hf_llama().config  # 4 heads, 2 KV heads, MLP 128
    with pytest.raises(ValueError, match="must divide the model's 4 attention heads"):
        check_shardable(config, 3)
    check_shardable(config, 2)
    check_shardable(config, 4)  # each KV head replicated over two ranks
    config.num_attention_heads, config.num_key_value_heads = 12, 3
    with pytest.raises(ValueError, match="3 KV heads"):
        check_shardable(config, 4)


def test_the_step_plan_is_typed_msgpack() -> None:
    plan = ForwardPlan(FORWARD, rows=[3, 0], starts=[10, 0], extend_lens=[1, 7], width=11)
    assert decode_plan(encode_plan(plan)) == plan
    with pytest.raises(ValueError, match="width"):
        decode_plan(encode_plan(ForwardPlan(FORWARD, rows=[3], starts=[10], extend_lens=[1], width=4)))
    with pytest.raises(ValueError, match="unknown plan kind"):
        decode_plan(encode_plan(ForwardPlan("exec")))
    with pytest.raises(DecodeError):
        decode_plan(b"\x80\x04K\x00.")  # a pickle is never read
