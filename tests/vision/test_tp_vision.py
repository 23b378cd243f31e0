"""Images under tensor parallelism: the tiny LLaVA and Gemma 3 of tests/vision_models.py split over two ranks (real
processes joined by gloo on loopback) give the one-rank engine's greedy tokens. Rank 0 runs the vision tower and
sends each step's image embeddings with the step plan; the scenarios cover two requests with different images in
one batch (one holding two images), a chunk boundary inside (LLaVA) or before (Gemma 3) an image, and the same
image again from the prefix cache."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from ringserve.actors.engine.config import EngineConfig
from ringserve.actors.engine.models.weights import model_from_hf
from ringserve.actors.engine.parallel.tensor_parallel import close_group, init_group
from ringserve.actors.engine.scheduling.tp_engine import TPEngine, TPFollower, prepare_rank
from tests.engine_helpers import engine_for, tokens_of
from tests.vision.test_engine_vision import tokenized
from tests.scale_out.test_tensor_parallel import PROCESS_WAIT_S, TIMEOUT_S, _free_addr
from tests.vision_models import random_image, tiny_hf_vlm

# (engine config, waves: each a list of (rid, image seeds) run to completion before the next)
SCENARIOS: list[tuple[dict[str, Any], list[list[tuple[str, tuple[int, ...]]]]]] = [
    ({}, [[("a", (1,)), ("b", (2, 3))], [("a2", (1,))]]),
    ({"chunked_prefill_size": 20, "max_prefill_tokens": 20}, [[("c", (4,)), ("d", (5,))]]),
]


def _requests(processor: Any, wave: list[tuple[str, tuple[int, ...]]]) -> list[Any]:
    return [tokenized(processor, [random_image(s) for s in seeds], rid)[:2] for rid, seeds in wave]


def _serve(engine: Any, processor: Any, waves: list[list[tuple[str, tuple[int, ...]]]]) -> dict[str, Any]:
    """Each request's greedy tokens and cached prompt tokens, wave by wave."""
    out: dict[str, Any] = {}
    for wave in waves:
        for request, tensors in _requests(processor, wave):
            assert engine.add_request(request, tensors) is None, request.rid
        rows: dict[str, list[Any]] = {}
        while engine.has_work():
            for row in engine.step():
                assert row.finish is None or row.finish.type in ("stop", "length"), row.finish
                rows.setdefault(row.rid, []).append(row)
        out.update({rid: (tokens_of(r), r[0].cached_tokens) for rid, r in rows.items()})
    return out


def _rank_main(rank: int, addr: str, kind: str, queue: Any) -> None:
    torch.set_num_threads(1)
    group = None
    try:
        group = init_group(rank, 2, addr, "cpu", timeout_s=TIMEOUT_S)
        hf, processor = tiny_hf_vlm(kind)  # seeded: the same weights in both processes
        results: list[Any] = []
        for config_kwargs, waves in SCENARIOS:
            model = model_from_hf(hf.config, hf.state_dict(), "cpu")
            config = prepare_rank(model, EngineConfig(device="cpu", torch_threads=1, max_total_tokens=4096,
                                                      **config_kwargs), group)
            if rank:
                follower = TPFollower(model, config, group)
                follower.run()
                results.append(follower.steps)
            else:
                engine = TPEngine(model, config, group)
                results.append(_serve(engine, processor, waves))
                engine.close()
        queue.put(results)
    except BaseException as exc:  # the test reads what went wrong
        queue.put(f"error: {exc!r}")
        sys.exit(1)
    finally:
        close_group(group)


@pytest.mark.parametrize("kind", ["llava", "gemma3"])
def test_two_ranks_give_the_one_rank_engines_tokens(kind: str) -> None:
    ctx = mp.get_context("spawn")
    queues = [ctx.Queue() for _ in range(2)]
    addr = _free_addr()
    procs = [ctx.Process(target=_rank_main, args=(r, addr, kind, queues[r])) for r in (1, 0)][::-1]
    for p in reversed(procs):
        p.start()
    try:
        results = [q.get(timeout=PROCESS_WAIT_S) for q in queues]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert all(isinstance(r, list) for r in results), results
    hf, processor = tiny_hf_vlm(kind)
    for (config_kwargs, waves), got, steps in zip(SCENARIOS, results[0], results[1]):
        want = _serve(engine_for(hf, max_total_tokens=4096, **config_kwargs), processor, waves)
        assert got == want
        assert steps > 0  # the follower ran the forwards
    assert results[0][0]["a2"][1] > results[0][0]["a"][1]  # the same image again came from the prefix cache
    assert all(p.exitcode == 0 for p in procs)
