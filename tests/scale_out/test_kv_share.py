"""KV blocks shared between replicas over NATS (`--kv-share`): a replica sent a prompt another replica holds
fetches the blocks and gives exactly the tokens a computed prefix gives; a holder that is gone, or a block whose
checksum does not match, only means the rest is computed; the router hints where a prompt's blocks are."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from ringserve.actors.tokenizer.router import Router
from ringserve.bus.connection import BusConnection, Delivery
from ringserve.bus.embedded_server import EmbeddedNatsServer
from ringserve.bus.kv_blocks import BLOCK, block_hashes
from ringserve.bus.kv_transfer import KvFetchReply, KvFetchRequest, checksum, fetch_blocks
from ringserve.bus.kv_messages import KvEvents
from ringserve.bus.messages import Accepted, ReplicaLoad, RequestOutput, TokenizedRequest
from ringserve.bus.params import SamplingParams
from ringserve.bus.subjects import Subjects
from tests.otlp_receiver import OtlpReceiver
from tests.server_helpers import ServerHandle, start_server

BLOCKS = 5
PROMPT = [(7 * i + 3) % 500 + 3 for i in range(BLOCKS * BLOCK + 9)]
N = 8


@pytest.fixture(scope="module")
def spans() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def shared(tiny_model_dir: Path, nats_server: EmbeddedNatsServer, spans: OtlpReceiver) -> Iterator[ServerHandle]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        handle = start_server(str(tiny_model_dir), nats_url=nats_server.url,
                              extra=["--dp", "2", "--kv-tier-bytes", str(64 << 20), "--kv-share",
                                     "--otlp-endpoint", spans.url])
    yield handle
    assert handle.stop() == 0


def replicas(server: ServerHandle) -> list[dict[str, Any]]:
    return sorted(httpx.get(server.base_url + "/get_server_info", timeout=30).json()["replicas"],
                  key=lambda r: r["id"])


async def run_on(server: ServerHandle, replica: int, rid: str, ids: list[int], peer: int = -1,
                 peer_blocks: int = 0) -> list[int]:
    """Hand `ids` straight to scheduler replica `replica` (as a router would, with its hint) and read the
    request's greedy tokens from its output subject."""
    subjects = Subjects(server.namespace)
    bus = await BusConnection.connect(server.nats_url or "", "kv-share-test")
    outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()

    async def on_output(out: RequestOutput, delivery: Delivery) -> None:
        await outputs.put(out)

    try:
        await bus.subscribe(subjects.output(rid), RequestOutput, on_output)
        request = TokenizedRequest(rid=rid, input_ids=ids, sampling=SamplingParams(max_new_tokens=N, temperature=0,
                                                                                   ignore_eos=True),
                                   kv_peer=peer, kv_peer_blocks=peer_blocks)
        accepted = await bus.request(subjects.tokenized_for(replica), request, Accepted, 30)
        assert accepted.replica == replica
        tokens: list[int] = []
        while True:
            out = await asyncio.wait_for(outputs.get(), 120)
            assert out.error is None, out.error
            tokens += out.token_ids  # each output carries the tokens new since the last
            if out.finish is not None:
                return tokens
    finally:
        await bus.close()


def test_a_fetched_prefix_gives_the_computed_tokens(shared: ServerHandle, spans: OtlpReceiver) -> None:
    computed = asyncio.run(run_on(shared, 0, "computed", PROMPT))
    before = replicas(shared)[1]
    fetched = asyncio.run(run_on(shared, 1, "fetched", PROMPT, peer=0, peer_blocks=BLOCKS))
    after = replicas(shared)
    assert fetched == computed and len(computed) == N
    assert after[1]["kv_fetched_blocks"] - before["kv_fetched_blocks"] == BLOCKS
    assert after[1]["kv_tier_loaded_blocks"] - before["kv_tier_loaded_blocks"] == BLOCKS  # loaded, not computed
    assert after[0]["kv_served_blocks"] >= BLOCKS
    scrape = httpx.get(shared.base_url + "/metrics", timeout=30).text
    assert "ringserve:kv_fetched_blocks" in scrape
    fetch = spans.wait_for(lambda got: any(s.name == "kv fetch" for s in got))
    [span] = [s for s in fetch if s.name == "kv fetch"]  # the request's trace shows the fetch as its own span
    assert span.attributes["ringserve.kv.blocks_fetched"] == BLOCKS and span.attributes["ringserve.kv.holder"] == 0


def test_a_holder_that_is_gone_means_the_prefix_is_computed(shared: ServerHandle) -> None:
    ids = [i % 400 + 5 for i in range(3 * BLOCK + 4)]
    computed = asyncio.run(run_on(shared, 0, "alone", ids))
    before = replicas(shared)[1]["kv_fetch_failures"]
    fetched = asyncio.run(run_on(shared, 1, "no-holder", ids, peer=7, peer_blocks=3))  # no replica 7
    assert fetched == computed
    assert replicas(shared)[1]["kv_fetch_failures"] == before + 1


def test_a_block_with_a_bad_checksum_ends_the_fetch_there(nats_server: EmbeddedNatsServer) -> None:
    """A holder whose second block arrives altered: the first is kept, the rest computed."""
    good = [bytes([i]) * 1000 for i in range(3)]

    async def scenario() -> tuple[int, str, int, str]:
        bus = await BusConnection.connect(nats_server.url, "kv-holder")

        async def serve(ask: KvFetchRequest, delivery: Delivery) -> KvFetchReply:
            blocks = good[ask.first_block:ask.first_block + ask.max_blocks]
            sums = [checksum(b) for b in blocks]
            # block 1 is corrupted in flight: its bytes no longer match the checksum sent with them
            blocks = [b[:-1] + b"x" if ask.first_block + i == 1 else b for i, b in enumerate(blocks)]
            return KvFetchReply(blocks=blocks, checksums=sums)

        try:
            await bus.subscribe("kvtest.kv.fetch.0", KvFetchRequest, serve)
            ask = KvFetchRequest([1] * 3 * BLOCK, None, "ns", 0, 3)
            bad = await fetch_blocks(bus, "kvtest.kv.fetch.0", ask, 10.0)
            later = await fetch_blocks(bus, "kvtest.kv.fetch.0", KvFetchRequest([1] * 3 * BLOCK, None, "ns", 1, 2),
                                       10.0)
            gone = await fetch_blocks(bus, "kvtest.kv.fetch.9", ask, 2.0)
            return len(bad.blocks), bad.stopped, len(later.blocks), gone.stopped
        finally:
            await bus.close()

    kept, why, later, gone = asyncio.run(scenario())
    assert kept == 1 and "checksum" in why
    assert later == 0  # its first block is the corrupted one
    assert gone and not gone.startswith("the holder has")


def test_the_router_names_the_replica_holding_more_of_the_prompt() -> None:
    router = Router()
    for replica in (0, 1):
        router.on_heartbeat(ReplicaLoad(replica=replica, interval=1.0), now=0.0)
    hashes = block_hashes(PROMPT, BLOCK)
    router.on_kv_events(KvEvents(replica=0, epoch="e0", seq=1, stored=hashes[:4]))
    router.on_kv_events(KvEvents(replica=1, epoch="e1", seq=1, stored=hashes[:1]))
    assert router.holder(PROMPT, 1, now=0.5) == (0, 4)
    assert router.holder(PROMPT, 0, now=0.5) == (-1, 0)  # the chosen replica holds the most already
    assert router.holder([9] * BLOCK, 1, now=0.5) == (-1, 0)


@pytest.fixture(scope="module")
def split(tiny_model_dir: Path) -> Iterator[ServerHandle]:
    """Replica 0 prefills, replica 1 decodes, on the launcher's own NATS with its per-role users (the replicas'
    prefill and fetch exchanges under their permissions)."""
    handle = start_server(str(tiny_model_dir),
                          extra=["--dp", "2", "--replica-role", "prefill,decode", "--kv-tier-bytes", str(64 << 20),
                                 "--kv-share", "--prefill-timeout", "3"])
    yield handle
    assert handle.stop() == 0


def generate(server: ServerHandle, ids: list[int]) -> dict[str, Any]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": N, "temperature": 0, "ignore_eos": True}}
    reply = httpx.post(server.base_url + "/generate", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_a_prefill_replica_computes_the_prompt_and_the_decode_replica_streams(split: ServerHandle,
                                                                              tiny_model_dir: Path) -> None:
    from transformers import LlamaForCausalLM

    from tests.engine_helpers import hf_greedy

    hf = LlamaForCausalLM.from_pretrained(tiny_model_dir).eval()
    before = replicas(split)
    out = generate(split, PROMPT)
    after = replicas(split)
    assert out["output_ids"] == hf_greedy(hf, PROMPT, N, None)
    assert [r["requests_routed"] - b["requests_routed"] for r, b in zip(after, before)] == [0, 1]
    assert after[0]["kv_served_blocks"] - before[0]["kv_served_blocks"] == BLOCKS  # computed on the prefill side
    assert after[1]["kv_fetched_blocks"] - before[1]["kv_fetched_blocks"] == BLOCKS
    assert after[1]["kv_tier_loaded_blocks"] - before[1]["kv_tier_loaded_blocks"] == BLOCKS


def test_a_stopped_prefill_replica_means_the_decode_replica_computes(split: ServerHandle,
                                                                     tiny_model_dir: Path) -> None:
    import os
    import signal

    ids = [(5 * i + 1) % 450 + 7 for i in range(2 * BLOCK + 3)]
    pid = split.actor_pids()["scheduler0"]
    failures = replicas(split)[1]["kv_fetch_failures"]
    os.kill(pid, signal.SIGSTOP)  # alive but silent: takes the prefill request, never answers
    try:
        stopped = generate(split, ids)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert len(stopped["output_ids"]) == N
    assert replicas(split)[1]["kv_fetch_failures"] == failures + 1
    assert generate(split, ids)["output_ids"] == stopped["output_ids"]  # computed or fetched: the same tokens


def test_the_router_keys_image_tokens_by_their_image() -> None:
    """Two prompts alike but for their image: the router hashes them apart, as the replicas' caches key them."""
    from ringserve.bus.images import ImageRef, image_key

    ids = [5] * 10 + [9] * BLOCK + [6] * BLOCK  # an image's run of 64 image tokens (id 9) after 10 text tokens
    cat, dog = (image_key(ids, [ImageRef(h * 64, 10, BLOCK, "handle")]) for h in ("a", "b"))
    router = Router()
    for replica in (0, 1):
        router.on_heartbeat(ReplicaLoad(replica=replica, interval=1.0), now=0.0)
    router.on_kv_events(KvEvents(replica=1, epoch="e1", seq=1, stored=block_hashes(cat, BLOCK)))
    assert block_hashes(cat, BLOCK)[0] != block_hashes(dog, BLOCK)[0]
    assert router.route(cat, now=0.5) == 1  # where that image's prompt is cached
    assert router.holder(dog, 0, now=0.5) == (-1, 0)  # nobody holds the other image's
