"""A request's reply subject is the sender's choice: an actor answers only in the requester's own inbox, so no
sender can make it publish into a stream's API, the span stream or another client's outputs (bus/connection.py
`subscribe(reply_inbox=...)`, bus/permissions.py `reply_inbox`). Here on an open NATS server, so the bus's own
check is what is tested, not the server's permissions."""

from __future__ import annotations

import asyncio

import nats

from ringserve.bus.codec import decode, encode
from ringserve.bus.connection import BusConnection, Delivery
from ringserve.bus.embedded_server import EmbeddedNatsServer
from ringserve.bus.messages import Accepted, GenerateRequest
from ringserve.bus.permissions import reply_inbox
from tests.faults.nats_auth_helpers import next_message

NS = "inj"
HOSTILE = [f"{NS}.client.alice.out.victim1", f"$JS.API.STREAM.PURGE.{NS}-spans", f"{NS}.spans.entry",
           f"_INBOX.{NS}.client.alice.x", f"{NS}.req.tokenized"]


def test_replies_go_only_to_the_requesters_inbox(nats_server: EmbeddedNatsServer) -> None:
    async def run() -> list[str]:
        bus = await BusConnection.connect(nats_server.url, "answerer")
        sender = await nats.connect(nats_server.url)
        try:
            async def accept(req: GenerateRequest, delivery: Delivery) -> Accepted:
                return Accepted(rid=req.rid)

            await bus.subscribe(f"{NS}.client.bob.submit", GenerateRequest, accept,
                                reply_inbox=lambda subject: reply_inbox(NS, subject))
            await bus.subscribe(f"{NS}.req.submit", GenerateRequest, accept)  # the default: any inbox
            candidates = HOSTILE + [f"_INBOX.{NS}.client.bob.ok", "_INBOX.plain.ok"]
            watches = [await sender.subscribe(subject) for subject in candidates]
            await bus.client.flush()
            await sender.flush()
            body = encode(GenerateRequest(rid="r", text="x"))
            for subject in (f"{NS}.client.bob.submit", f"{NS}.req.submit"):
                for reply in candidates:
                    await sender.publish(subject, body, reply=reply)
            await sender.flush()
            await asyncio.sleep(1.0)  # every reply that will come has come by now
            answered: list[str] = []
            for watch in watches:
                while (msg := await next_message(watch, 0.05)) is not None:
                    if msg.reply:  # the submission itself, seen where a reply subject is also a request subject
                        continue
                    assert decode(msg.data, Accepted).rid == "r"
                    answered.append(msg.subject)
            return answered
        finally:
            await sender.close()
            await bus.close()

    answered = asyncio.run(run())
    # bob's submissions are answered in bob's inbox only; the entry's subject in any inbox, never elsewhere
    assert sorted(answered) == sorted([f"_INBOX.{NS}.client.bob.ok", f"_INBOX.{NS}.client.alice.x",
                                       f"_INBOX.{NS}.client.bob.ok", "_INBOX.plain.ok"])
