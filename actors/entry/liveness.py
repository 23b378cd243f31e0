"""Which actors are alive, from their heartbeats on `{ns}.control.heartbeat` (every actor beats every 0.5 s).

Beats come from a thread of each actor's own (actors/common/heartbeat.py), so a busy actor (a long engine step,
a busy event loop) still beats; only a stalled process or one cut off from NATS falls silent. `silence_s`
(`--heartbeat-timeout`, default 10 s) is therefore long: well past any scheduling hiccup of a busy host. A
process that ended is known at once instead: the launcher sees it exit and says so (`ActorGone` on
`{ns}.control.gone`, `gone()`), and it counts as silent from then on.

The entry keeps the last beat of every (role, rank). A role is healthy while at least one of its actors beat
within `silence_s` seconds; `/health` needs every role in `REQUIRED_ROLES` healthy. An actor of a role in
`CRITICAL_ROLES` (a scheduler replica, a detokenizer) that beat before and then falls silent is "lost": the
open streams it held depend on it. While another actor of its role beats, the ring degrades: the entry ends
only the streams the lost one held (each stream knows its replica and its detokenizer from `Accepted`) and
keeps admitting. When it was the last of its role, the entry ends every stream and refuses new requests until
one beats again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from ringserve.bus.messages import Heartbeat, ReplicaLoad
from ringserve.bus.replica_replies import asked, left
from ringserve.bus.ring_client import TRACK_SETTLE_SECONDS
from ringserve.observability.logging import log_event

log = logging.getLogger("entry")
REQUIRED_ROLES = ("scheduler", "tokenizer", "detokenizer")
CRITICAL_ROLES = ("scheduler", "detokenizer")  # their silence strands the open streams they hold
DEFAULT_SILENCE_SECONDS = 10.0
CHECK_SECONDS = 0.25


@dataclass
class ActorBeat:
    """The last heartbeat of one actor."""

    role: str
    rank: int
    pid: int
    live_rids: int
    seen_at: float  # time.monotonic() of the last beat
    load: ReplicaLoad | None = None  # a scheduler replica's
    loop_lag: float = 0.0  # how old the beat's numbers were: the actor's event loop was busy that long
    gone: str = ""  # why its process ended, as the launcher said (then it is silent from that moment)
    counters: dict[str, int] = field(default_factory=dict)  # its own, as its last beat said (Heartbeat.counters)

    @property
    def name(self) -> str:
        """The actor's name, e.g. "scheduler0"."""
        return f"{self.role}{self.rank}"


def _left(beat: ActorBeat) -> bool:
    """A replica that drained and said so in its last beat left on purpose: not lost."""
    return beat.load is not None and left(beat.load, beat.live_rids)


class LivenessMonitor:
    """Tracks heartbeats and notices critical actors going silent."""

    def __init__(self, silence_s: float = DEFAULT_SILENCE_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.silence_s = silence_s
        self._clock = clock
        self._beats: dict[str, ActorBeat] = {}
        self._lost: set[str] = set()  # critical actors reported silent and not heard from since
        self._replaced: set[str] = set()  # critical actors that beat from a new process before their silence showed
        self._gone_pids: dict[str, int] = {}  # per actor: the pid the launcher said ended (its late beats are void)

    def record(self, beat: Heartbeat) -> None:
        """Note a heartbeat."""
        name = f"{beat.role}{beat.rank}"
        if self._gone_pids.get(name) == beat.pid:  # sent before its process ended, read after: no sign of life
            return
        previous = self._beats.get(name)
        if previous is not None and previous.pid != beat.pid and beat.role in CRITICAL_ROLES and name not in self._lost:
            self._replaced.add(name)  # restarted quickly: the old process and the streams it held are gone
        self._beats[name] = ActorBeat(beat.role, beat.rank, beat.pid, beat.live_rids, self._clock(), beat.load,
                                      beat.loop_lag, counters=beat.counters)
        if name in self._lost:
            self._lost.discard(name)
            log_event(log, logging.INFO, "actor heartbeat back", actor=name, pid=beat.pid)

    def gone(self, role: str, rank: int, pid: int, cause: str) -> None:
        """The launcher saw process `pid` of actor `role``rank` end: it is silent from now on (`lost()` names it
        at once, unless it left on purpose). Nothing changes when that actor already beats from another pid."""
        name = f"{role}{rank}"
        self._gone_pids[name] = pid
        beat = self._beats.get(name)
        if beat is not None and beat.pid == pid:
            beat.gone = cause or "its process ended"

    def _alive(self, beat: ActorBeat, now: float) -> bool:
        return not beat.gone and now - beat.seen_at <= self.silence_s

    def why_lost(self, names: list[str]) -> str:
        """Why the lost actors `names` count as lost: their process ended, or their heartbeat silence."""
        return "; ".join(f"{name}: {self._beats[name].gone}" if name in self._beats and self._beats[name].gone
                         else f"{name}: no heartbeat for {self.silence_s:g}s" for name in names)

    def silent_roles(self) -> list[str]:
        """The roles of REQUIRED_ROLES with no actor that beat within `silence_s` seconds."""
        now = self._clock()
        alive = {b.role for b in self._beats.values() if self._alive(b, now)}
        return [role for role in REQUIRED_ROLES if role not in alive]

    def roles(self) -> dict[str, dict[str, Any]]:
        """Per role: "ok" or "silent", and the names of its live and silent actors."""
        now = self._clock()
        out: dict[str, dict[str, Any]] = {}
        for role in REQUIRED_ROLES:
            beats = sorted((b for b in self._beats.values() if b.role == role), key=lambda b: b.rank)
            live = [b.name for b in beats if self._alive(b, now)]
            out[role] = {"status": "ok" if live else "silent", "live": live,
                         "silent": [b.name for b in beats if not self._alive(b, now)]}
        return out

    def replicas_to_ask(self) -> list[int]:
        """The scheduler replicas (their ids) an operator command or load query waits for (bus/replica_replies.py
        `asked`): the schedulers whose beats carry a load (a `--tp` replica's follower ranks beat as schedulers
        too, without one), unless they left or have been silent far longer than `silence_s`."""
        now = self._clock()
        return sorted(b.rank for b in self._beats.values()
                      if b.role == "scheduler" and b.load is not None and not b.gone
                      and asked(b.load, b.live_rids, now - b.seen_at))

    def live_members(self, role: str) -> list[int]:
        """The ids (ranks) of `role`'s actors that beat within `silence_s` seconds."""
        now = self._clock()
        return sorted(b.rank for b in self._beats.values() if b.role == role and self._alive(b, now))

    def actors(self) -> dict[str, dict[str, Any]]:
        """Every actor heard from: pid, seconds since its last beat, and its count of per-request state."""
        now = self._clock()
        return {name: {"pid": b.pid, "age_s": round(now - b.seen_at, 3), "live_rids": b.live_rids,
                       "loop_lag_s": b.loop_lag, **({"gone": b.gone} if b.gone else {}),
                       **({"counters": b.counters} if b.counters else {})}
                for name, b in sorted(self._beats.items())}

    def lost(self) -> list[str]:
        """Critical actors that beat before and are silent now."""
        now = self._clock()
        return sorted(name for name, b in self._beats.items()
                      if b.role in CRITICAL_ROLES and not self._alive(b, now) and not _left(b))

    def blocking(self) -> list[str]:
        """The lost actors that stop new requests: those of a critical role with no live actor left (while
        another beats, it takes the new requests)."""
        return [name for name in self.lost() if not self.live_members(self._beats[name].role)]

    def degraded(self, names: list[str]) -> dict[str, set[int]] | None:
        """The lost actors `names` by role (`{"detokenizer": {1}}`) when each has another live actor of its role,
        so only the streams they held end; None when one was the last of its role (every stream ends)."""
        out: dict[str, set[int]] = {}
        for name in names:
            beat = self._beats[name]
            if not self.live_members(beat.role):
                return None
            out.setdefault(beat.role, set()).add(beat.rank)
        return out

    def is_lost(self, role: str, rank: int | None) -> bool:
        """Whether actor `rank` of `role` is in `lost()` (None: unknown, never lost)."""
        return rank is not None and f"{role}{rank}" in self.lost()

    def newly_lost(self) -> list[str]:
        """`lost()` minus those already returned by an earlier call (each loss is reported once), and the critical
        actors replaced by a new process (a new pid) that was up before the old one's silence showed."""
        lost = self.lost()
        new = [name for name in lost if name not in self._lost]
        self._lost.update(new)
        replaced, self._replaced = sorted(self._replaced - set(new)), set()
        return new + replaced

    async def wait_for_roles(self, timeout: float) -> None:
        """Return once every required role has beat and one heartbeat interval has passed (so every actor that
        runs has beat: all of a `--dp` ring's replicas count from the first request), or after `timeout`
        seconds."""
        start = self._clock()
        deadline, settled = start + timeout, start + TRACK_SETTLE_SECONDS
        while (self.silent_roles() or self._clock() < settled) and self._clock() < deadline:
            await asyncio.sleep(0.05)

    async def watch(self, on_lost: Callable[[list[str]], Awaitable[None]],
                    on_tick: Callable[[], None] | None = None) -> None:
        """Forever: every CHECK_SECONDS call `on_tick`, and `on_lost(names)` when critical actors fall silent.

        A tick that comes late (this event loop was busy) judges nothing: the beats may be waiting unread.
        """
        last = self._clock()
        while True:
            await asyncio.sleep(CHECK_SECONDS)
            now = self._clock()
            late = now - last > CHECK_SECONDS + 0.5
            last = now
            if on_tick is not None:
                on_tick()
            if late:
                continue
            names = self.newly_lost()
            if names:
                log_event(log, logging.ERROR, "actor heartbeat lost", actors=",".join(names),
                          silence_s=self.silence_s)
                await on_lost(names)
