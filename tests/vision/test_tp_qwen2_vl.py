"""Qwen2-VL over two tensor-parallel ranks (real processes joined by gloo on loopback): image requests (two images
of different sizes in one, chunked prefill crossing an image) and a text request, batched, give transformers'
greedy tokens. The step plan carries each token's M-RoPE position and the image tokens' [t, h, w] positions to
the other rank, which rotates with them."""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.multiprocessing as mp

from ringserve.actors.engine.config import EngineConfig
from ringserve.actors.engine.models.weights import model_from_hf
from ringserve.actors.engine.parallel.tensor_parallel import close_group, init_group
from ringserve.actors.engine.scheduling.tp_engine import TPEngine, TPFollower, prepare_rank
from ringserve.bus.messages import TokenizedRequest
from tests.engine_helpers import greedy, tokens_of
from tests.vision.test_engine_qwen2_vl import WIDE, tokenized
from tests.vision.test_engine_vision import NEW_TOKENS, hf_tokens
from tests.scale_out.test_tensor_parallel import PROCESS_WAIT_S, TIMEOUT_S, _free_addr
from tests.vision_models import process, random_image, tiny_hf_vlm


def _requests(processor: Any) -> list[tuple[TokenizedRequest, Any, Any]]:
    """Two image requests (the second with two images of different sizes) and a text one."""
    text = process(processor, [], "Say hello.")
    return [tokenized(processor, [random_image(1)], "one"),
            tokenized(processor, [random_image(2), random_image(3, *WIDE)], "two"),
            (TokenizedRequest("text", text["input_ids"][0].tolist(), greedy(NEW_TOKENS, ignore_eos=True)), {}, text)]


def _rank_main(rank: int, addr: str, queue: Any) -> None:
    torch.set_num_threads(1)
    group = None
    try:
        group = init_group(rank, 2, addr, "cpu", timeout_s=TIMEOUT_S)
        hf, processor = tiny_hf_vlm("qwen2_vl")  # seeded: the same weights in both processes
        model = model_from_hf(hf.config, hf.state_dict(), "cpu")
        config = prepare_rank(model, EngineConfig(device="cpu", torch_threads=1, max_total_tokens=4096,
                                                  chunked_prefill_size=12, max_prefill_tokens=12), group)
        if rank:
            follower = TPFollower(model, config, group)
            follower.run()
            queue.put(follower.steps)
            return
        engine = TPEngine(model, config, group)
        for request, tensors, _ in _requests(processor):
            assert engine.add_request(request, tensors) is None, request.rid
        rows: list[Any] = []
        while engine.has_work():
            rows += engine.step()
        engine.close()
        queue.put({rid: tokens_of([r for r in rows if r.rid == rid]) for rid in ("one", "two", "text")})
    except BaseException as exc:  # the test reads what went wrong
        queue.put(f"error: {exc!r}")
        sys.exit(1)
    finally:
        close_group(group)


def test_two_ranks_give_transformers_tokens_for_images_and_text() -> None:
    ctx = mp.get_context("spawn")
    queues = [ctx.Queue() for _ in range(2)]
    addr = _free_addr()
    procs = [ctx.Process(target=_rank_main, args=(r, addr, queues[r])) for r in (0, 1)]
    for p in reversed(procs):
        p.start()
    try:
        leader, steps = [q.get(timeout=PROCESS_WAIT_S) for q in queues]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert isinstance(leader, dict), leader
    hf, processor = tiny_hf_vlm("qwen2_vl")
    for request, _, inputs in _requests(processor):
        assert leader[request.rid] == hf_tokens(hf, inputs), request.rid
    assert steps > 0  # the follower ran the forwards
    assert all(p.exitcode == 0 for p in procs)
