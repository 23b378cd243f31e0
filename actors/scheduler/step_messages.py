"""Numbered step messages: the scheduler's `BatchTokenOutput`s to each detokenizer carry `seq` 1, 2, ... of this
replica's incarnation (`epoch`), so the detokenizer can tell a lost message (a gap) from a slow step.

A message too large for NATS is split in halves (recursively) before it is numbered, so a split never skips a
number; a row too large alone is returned, unsent.
"""

from __future__ import annotations

import uuid

from ringserve.bus.connection import BusConnection, PayloadTooLarge
from ringserve.bus.messages import BatchTokenOutput, TokenRow


class StepNumbering:
    """The next `seq` per detokenizer subject of one scheduler incarnation, and the publishing that uses it."""

    def __init__(self, replica: int) -> None:
        """`replica`: this scheduler replica's id; this process is a new incarnation of it (a new `epoch`)."""
        self.replica = replica
        self.epoch = uuid.uuid4().hex[:16]
        self._sent: dict[str, int] = {}  # subject -> the seq of its last message sent

    async def publish(self, bus: BusConnection, subject: str, step: int, rows: list[TokenRow],
                      traceparent: str | None = None) -> list[TokenRow]:
        """Publish `rows` as numbered messages on `subject` (split while too large); the rows too large alone."""
        seq = self._sent.get(subject, 0) + 1
        try:
            await bus.publish(subject, BatchTokenOutput(step, rows, self.replica, self.epoch, seq), traceparent)
        except PayloadTooLarge:
            if len(rows) <= 1:
                return list(rows)
            half = len(rows) // 2
            return (await self.publish(bus, subject, step, rows[:half], traceparent)
                    + await self.publish(bus, subject, step, rows[half:], traceparent))
        self._sent[subject] = seq
        return []
