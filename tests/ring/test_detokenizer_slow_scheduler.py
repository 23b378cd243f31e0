"""The detokenizer gives up on a request only on evidence, never because its scheduler is slow.

Over the real bus to the real detokenizer: a request whose next row comes 35 s after its first (a long prefill
beside it on a busy host) still ends cleanly, with no "first row never arrived" error. Units of the evidence
(`LossEvidence`): a gap in the numbered step messages puts the held requests of that incarnation in doubt, a row
clears the doubt, one with no row for SUSPECT_SECONDS is overdue, and a replica's new epoch drops its old
incarnation's requests."""

from __future__ import annotations

import asyncio

import nats

from ringserve.actors.detokenizer.loss_evidence import SUSPECT_SECONDS, LossEvidence
from ringserve.bus.codec import decode, encode
from ringserve.bus.messages import BatchTokenOutput, DecodeParams, FinishReason, RequestOutput, TokenRow
from tests.server_helpers import ServerHandle

SLOW_STEP_SECONDS = 35.0  # past the 30 s after which the detokenizer used to forget a request without rows


def _row(rid: str, ids: list[int], done: int, first: bool = False, finish: str | None = None) -> TokenRow:
    return TokenRow(rid=rid, token_ids=ids, prompt_tokens=3, completion_tokens=done,
                    decode=DecodeParams() if first else None, finish=FinishReason(finish) if finish else None)


def _batch(seq: int, rows: list[TokenRow], epoch: str = "e1", replica: int = 0) -> BatchTokenOutput:
    return BatchTokenOutput(step=seq, rows=rows, replica=replica, epoch=epoch, seq=seq)


def test_a_request_slow_to_get_its_next_row_is_not_given_up(smollm_server: ServerHandle) -> None:
    ns = smollm_server.namespace

    async def scenario() -> list[RequestOutput]:
        nc = await nats.connect(smollm_server.nats_url)
        sub = await nc.subscribe(f"{ns}.out.slow-1")
        await nc.flush()
        subject = f"{ns}.tokens.0"
        await nc.publish(subject, encode(_batch(1, [_row("slow-1", [300], 1, first=True)], epoch="slow")))
        await nc.flush()
        await asyncio.sleep(SLOW_STEP_SECONDS)
        await nc.publish(subject, encode(_batch(2, [_row("slow-1", [301], 2)], epoch="slow")))
        await nc.publish(subject, encode(_batch(3, [_row("slow-1", [302], 3, finish="length")], epoch="slow")))
        await nc.flush()
        outputs: list[RequestOutput] = []
        try:
            while not outputs or not (outputs[-1].error or outputs[-1].finish):  # until its last output
                outputs.append(decode((await sub.next_msg(timeout=10)).data, RequestOutput))
        finally:
            await nc.close()
        return outputs

    outputs = asyncio.run(scenario())
    assert all(o.error is None for o in outputs), [o.error for o in outputs]
    assert [o.seq for o in outputs] == [0, 1, 2], outputs
    assert outputs[-1].finish is not None and outputs[-1].finish.type == "length"


def test_a_gap_puts_held_requests_in_doubt_and_a_row_clears_it() -> None:
    evidence = LossEvidence()
    assert evidence.on_message(_batch(1, []), 0.0) == []
    for rid in ("a", "b"):
        evidence.on_row(rid, _batch(1, []))
    evidence.on_message(_batch(2, []), 1.0)
    assert evidence.suspects() == [], "consecutive messages: nothing lost, however far apart"
    evidence.on_message(_batch(4, []), 100.0)  # 3 was lost
    assert sorted(evidence.suspects()) == ["a", "b"]
    evidence.on_row("a", _batch(4, []))  # a's row came: its own tokens judge it
    assert evidence.suspects() == ["b"]
    assert evidence.overdue(100.0 + SUSPECT_SECONDS - 1, {"a", "b"}) == []
    assert evidence.overdue(100.0 + SUSPECT_SECONDS + 1, {"a", "b"}) == ["b"]
    assert evidence.overdue(100.0 + SUSPECT_SECONDS + 1, {"a"}) == [], "one no longer held is not overdue"


def test_unnumbered_messages_judge_nothing_and_a_new_epoch_drops_the_old_incarnations_requests() -> None:
    evidence = LossEvidence()
    evidence.on_message(BatchTokenOutput(step=1, rows=[]), 0.0)
    evidence.on_message(BatchTokenOutput(step=9, rows=[]), 0.0)
    assert evidence.suspects() == []
    evidence.on_message(_batch(1, [], epoch="old", replica=1), 0.0)
    evidence.on_row("x", _batch(1, [], epoch="old", replica=1))
    evidence.on_message(_batch(1, [], epoch="other", replica=2), 0.0)
    evidence.on_row("y", _batch(1, [], epoch="other", replica=2))
    assert evidence.on_message(_batch(1, [], epoch="new", replica=1), 5.0) == ["x"]
    assert evidence.on_message(_batch(2, [], epoch="new", replica=1), 5.0) == []
