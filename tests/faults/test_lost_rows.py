"""A lost step message, sent as the scheduler would over the real bus to the real detokenizer: a request whose
first row never came, or whose rows skip tokens, ends at once with a 503 error event, never a shorter text or
a stall; its later rows are dropped, and the ring keeps serving."""

from __future__ import annotations

import asyncio
import httpx
import nats

from ringserve.bus.codec import decode, encode
from ringserve.bus.messages import BatchTokenOutput, DecodeParams, FinishReason, RequestOutput, TokenRow
from tests.server_helpers import ServerHandle


def _row(rid: str, ids: list[int], done: int, first: bool = False, finish: str | None = None) -> TokenRow:
    return TokenRow(rid=rid, token_ids=ids, prompt_tokens=3, completion_tokens=done,
                    decode=DecodeParams() if first else None, finish=FinishReason(finish) if finish else None)


def test_missing_first_row_and_gaps_end_the_request_with_an_error(smollm_server: ServerHandle) -> None:
    ns = smollm_server.namespace

    async def scenario() -> dict[str, list[RequestOutput]]:
        nc = await nats.connect(smollm_server.nats_url)
        sub = await nc.subscribe(f"{ns}.out.*")
        await nc.flush()
        steps = [
            [_row("lost-first", [300], 2)],  # rows 0..0 lost: no first row, so no DecodeParams
            [_row("lost-gap", [300, 301], 2, first=True), _row("lost-none", [300], 1, first=True)],
            [_row("lost-gap", [302], 4), _row("lost-none", [301], 2)],  # lost-gap skips token 2
            [_row("lost-gap", [303], 5, finish="length"), _row("lost-first", [304], 3, finish="length"),
             _row("lost-none", [302], 3, finish="length")],
        ]
        for n, rows in enumerate(steps):
            await nc.publish(f"{ns}.tokens.0", encode(BatchTokenOutput(step=n, rows=rows)))
        await nc.flush()
        outputs: dict[str, list[RequestOutput]] = {}
        try:
            while sum(len(v) for v in outputs.values()) < 6:
                msg = await sub.next_msg(timeout=5)
                out = decode(msg.data, RequestOutput)
                if out.rid.startswith("lost-"):
                    outputs.setdefault(out.rid, []).append(out)
            await asyncio.sleep(0.5)  # anything more (a late row's output) would arrive by now
            while True:
                msg = await sub.next_msg(timeout=0.1)
                out = decode(msg.data, RequestOutput)
                if out.rid.startswith("lost-"):
                    outputs.setdefault(out.rid, []).append(out)
        except (asyncio.TimeoutError, nats.errors.TimeoutError):
            pass
        await nc.close()
        return outputs

    outputs = asyncio.run(scenario())
    [first] = outputs["lost-first"]
    assert first.error is not None and first.error.code == 503 and "never arrived" in first.error.message
    gap = outputs["lost-gap"]
    assert [o.seq for o in gap] == [0, 1] and gap[0].error is None and gap[1].error is not None
    assert "tokens 2..2" in gap[1].error.message, "the error says what was lost; the later row is dropped"
    clean = outputs["lost-none"]
    assert [o.seq for o in clean] == [0, 1, 2] and clean[-1].finish is not None and clean[-1].error is None
    reply = httpx.post(smollm_server.base_url + "/generate", json={"text": "Hi", "sampling_params": {
        "max_new_tokens": 2}}, timeout=60)
    assert reply.status_code == 200




def test_a_request_whose_last_rows_never_come_is_forgotten_after_its_abort(smollm_server: ServerHandle) -> None:
    """Its final rows lost (a hung node), the requester gives up and aborts: the detokenizer frees its state
    within its abort grace, though no row ends it."""
    from ringserve.actors.detokenizer.actor import ABORT_GRACE_SECONDS
    from ringserve.bus.messages import AbortRequest

    ns = smollm_server.namespace

    def held() -> int:
        info = httpx.get(smollm_server.base_url + "/get_server_info", timeout=10).json()
        return sum(a["live_rids"] for name, a in info["actors"].items() if name.startswith("detokenizer"))

    async def scenario() -> list[int]:
        nc = await nats.connect(smollm_server.nats_url)
        await nc.publish(f"{ns}.tokens.0", encode(BatchTokenOutput(step=0, rows=[_row("lost-tail", [300], 1,
                                                                                         first=True)])))
        await nc.flush()
        seen = []
        for _ in range(20):  # the heartbeat (every 0.5 s) reports it held
            await asyncio.sleep(0.25)
            seen.append(held())
            if seen[-1]:
                break
        await nc.publish(f"{ns}.abort.lost-tail", encode(AbortRequest(rid="lost-tail", reason="stalled")))
        await nc.flush()
        await asyncio.sleep(ABORT_GRACE_SECONDS + 2.5)  # the grace, a sweep (1 s) and a heartbeat
        seen.append(held())
        await nc.close()
        return seen

    seen = asyncio.run(scenario())
    assert seen[-2] >= 1 and seen[-1] == 0, seen
