"""Evidence that a request's rows were lost, from the numbering of the scheduler's step messages.

Each `BatchTokenOutput` names its replica, that replica's incarnation (`epoch`) and its `seq` on this
detokenizer's subject (actors/scheduler/step_messages.py). Messages of one incarnation arrive in order, so:

- a gap in `seq` means messages were lost: every request held from that incarnation may have lost rows. One
  whose next row comes is judged by that row (it follows on, or its tokens show the hole). One that gets no row
  at all may have lost its final row: after `SUSPECT_SECONDS` without a row since the gap, it ends with a 503.
- a new epoch of a replica means the old incarnation is gone: its requests get no more rows (the entry has ended
  them on the launcher's word or the heartbeat silence), so their state is dropped at once.

A slow scheduler produces neither: however long a step takes, a request it holds is never given up here.
"""

from __future__ import annotations

from typing import Iterable

from ringserve.bus.messages import BatchTokenOutput

SUSPECT_SECONDS = 30.0  # after a gap: a request of that incarnation with no row for this long lost its final row


class LossEvidence:
    """Tracks each scheduler incarnation's step-message numbering and the requests a gap put in doubt."""

    def __init__(self) -> None:
        self._last_seq: dict[str, int] = {}  # epoch -> the highest seq seen
        self._epoch_of_replica: dict[int, str] = {}
        self._epoch_of: dict[str, str] = {}  # held rid -> the incarnation its rows come from
        self._suspect: dict[str, float] = {}  # rid -> when a gap put it in doubt (time.monotonic())

    def on_message(self, batch: BatchTokenOutput, now: float) -> list[str]:
        """Note a step message (before its rows); the held rids whose incarnation ended (drop them now)."""
        if batch.seq <= 0 or not batch.epoch:  # unnumbered: nothing to judge
            return []
        ended: list[str] = []
        if batch.replica >= 0:
            old = self._epoch_of_replica.get(batch.replica)
            if old is not None and old != batch.epoch:
                ended = [rid for rid, epoch in self._epoch_of.items() if epoch == old]
                self._last_seq.pop(old, None)
            self._epoch_of_replica[batch.replica] = batch.epoch
        last = self._last_seq.get(batch.epoch)
        if last is not None and batch.seq > last + 1:
            for rid, epoch in self._epoch_of.items():
                if epoch == batch.epoch:
                    self._suspect.setdefault(rid, now)
        self._last_seq[batch.epoch] = max(batch.seq, last or 0)
        for rid in ended:
            self.forget(rid)
        return ended

    def on_row(self, rid: str, batch: BatchTokenOutput) -> None:
        """A row of `rid` came in `batch`: it is judged by its own tokens, no longer in doubt."""
        self._suspect.pop(rid, None)
        if batch.seq > 0 and batch.epoch:
            self._epoch_of[rid] = batch.epoch

    def forget(self, rid: str) -> None:
        """`rid` is no longer held here."""
        self._epoch_of.pop(rid, None)
        self._suspect.pop(rid, None)

    def overdue(self, now: float, held: Iterable[str]) -> list[str]:
        """The held rids a gap put in doubt `SUSPECT_SECONDS` ago that got no row since: their last rows were lost."""
        held = set(held)
        for rid in [rid for rid in self._suspect if rid not in held]:
            self.forget(rid)
        return [rid for rid, since in self._suspect.items() if now - since > SUSPECT_SECONDS]

    def suspects(self) -> list[str]:
        """The rids in doubt now."""
        return list(self._suspect)
