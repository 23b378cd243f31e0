"""Starts the actor processes, waits until each announces itself ready, and fail-stops the whole ring if
any of them dies or stalls (SGLang's answer to zombie servers: never keep serving with a dead part). The
exception is an actor of a role in `RESTARTABLE_ROLES` (a scheduler replica, a detokenizer) while another
actor of its role runs: the others serve on (the entry ends only the dead one's requests), and it is started
again after a backoff.

Actors start in stages (`ActorSpec.stage`): the entry only once every other actor is ready, so its port opens
on a ready ring. It is started held before that, once all but one actor of the stage before are ready (the
scheduler still loading its model): it imports its code meanwhile and starts when told (`_release`), which
takes its seconds of imports off the start-up's critical path.

A stall is an actor whose heartbeats stop for `watchdog_timeout` seconds while its process still exists
(stopped, or cut off from NATS: beats come from a thread of their own, so a busy actor still beats).

Whenever an actor's process ends (or is killed for a stall), the launcher says so on `{ns}.control.gone`
(`ActorGone`) before it restarts or fail-stops, so the entry ends the streams that actor held at once rather
than after its heartbeat silence (`--heartbeat-timeout`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

from ringserve.actors.common.runtime import HOLD_ENV
from ringserve.bus.connection import BusConnection, Delivery
from ringserve.bus.credentials import NatsCredentials
from ringserve.bus.embedded_server import die_with_parent
from ringserve.bus.messages import ActorGone, ActorReady, Heartbeat
from ringserve.bus.permissions import inbox_prefix
from ringserve.bus.subjects import Subjects
from ringserve.observability.logging import log_event

log = logging.getLogger("launcher")
STOP_GRACE_SECONDS = 10.0
STOP_DRAIN_SECONDS = 8.0  # of the grace, what the actors may spend draining before they are told to stop at once
# the order actors stop in (`_terminate_all`); roles not named (detokenizers, the trace exporter) stop last
SHUTDOWN_WAVES = (("entry", "tokenizer"), ("scheduler",))
DEFAULT_WATCHDOG_SECONDS = 30.0
ROLE_SECRETS = {"RINGSERVE_API_KEY": ("entry",), "RINGSERVE_ADMIN_API_KEY": ("entry",)}  # environment variable -> the roles that may see it


@dataclass
class ActorSpec:
    """One actor process to run: `python -m <module> <args>`."""

    role: str
    rank: int
    module: str
    args: list[str]
    stage: int = 0  # later stages start once every earlier actor is ready (the entry opens its port last)
    group: str = ""  # actors that live and die together (the ranks of a `--tp` replica): restarted as one

    @property
    def name(self) -> str:
        return f"{self.role}{self.rank}"


def exit_cause(returncode: int) -> str:
    """Why a process ended, from its `Popen.returncode` (negative: the signal that killed it)."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    number = -returncode
    try:
        name = signal.Signals(number).name
    except ValueError:
        name = f"signal {number}"
    cause = f"exited with code {returncode}: it was killed by {name} (signal {number})"
    if number == signal.SIGKILL:
        cause += (": often the kernel's out-of-memory killer (see `dmesg` or the container's OOMKilled status);"
                  " check the memory limit, or give the KV cache less with --max-total-tokens or"
                  " --mem-fraction-static")
    return cause


def describe_exit(name: str, pid: int, returncode: int) -> str:
    """The log line's subject for a process that ended: `actor NAME (pid N) ...`."""
    return f"actor {name} (pid {pid}) {exit_cause(returncode)}"


RESTART_BACKOFF = 1.0  # seconds before a failed replica or detokenizer starts again; doubles per restart of it
RESTART_BACKOFF_MAX = 30.0
RESTARTABLE_ROLES = ("scheduler", "detokenizer")  # roles whose members serve interchangeably
# seconds a group's other members get to exit on their own when one died (a `--tp` rank 0 fails its requests
# within its collective timeout, then exits), before they are killed
GROUP_EXIT_GRACE = 5.0


class Supervisor:
    """Owns the actor processes of one deployment."""

    def __init__(self, specs: list[ActorSpec], nats_url: str, subjects: Subjects,
                 watched: dict[str, subprocess.Popen[bytes]] | None = None,
                 watchdog_timeout: float = DEFAULT_WATCHDOG_SECONDS,
                 credentials: NatsCredentials | None = None) -> None:
        """`watched`: processes started elsewhere (the embedded nats-server) whose death also fail-stops.
        `credentials`: the launcher role's own NATS credentials (the actors get theirs through their args)."""
        self._credentials = credentials
        self._watchdog_timeout = watchdog_timeout
        self._last_beat: dict[str, float] = {}
        self._specs = specs
        self._nats_url = nats_url
        self._subjects = subjects
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._watched = dict(watched or {})
        self._stop = asyncio.Event()
        self._bus: BusConnection | None = None
        self._respawn_at: dict[str, float] = {}  # actors to start again, and when
        self.restarts: dict[str, int] = {}  # per actor name, since the launch
        self._gone_later: list[tuple[str, int, str]] = []  # (name, pid, why) of group members stopped with another

    async def run(self, startup_timeout: float, on_ready: Callable[[], None]) -> int:
        """Run until a signal (exit 0) or an actor's death or a failed start (exit 1)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._stop.set)
        code: int | None = 1
        try:
            code = await self.start(startup_timeout)
            if code is None:
                on_ready()
                code = await self.watch()
            return code
        finally:
            await self.close(drain=code == 0)

    async def start(self, startup_timeout: float) -> int | None:
        """Start every actor, stage by stage, each stage once the one before is ready; None once all are ready,
        else the exit code (0: stopped meanwhile, 1: an actor died or was not ready in time). `close` after."""
        self._bus = bus = await BusConnection.connect(
            self._nats_url, "launcher", credentials=self._credentials,
            inbox_prefix=inbox_prefix(self._subjects.namespace, "launcher"))
        ready: set[tuple[str, int]] = set()

        async def on_actor_ready(msg: ActorReady, delivery: Delivery) -> None:
            ready.add((msg.role, msg.rank))
            log_event(log, logging.INFO, "actor ready", actor=f"{msg.role}{msg.rank}", pid=msg.pid)

        async def on_heartbeat(beat: Heartbeat, delivery: Delivery) -> None:
            self._last_beat[f"{beat.role}{beat.rank}"] = time.monotonic()

        await bus.subscribe(self._subjects.ready, ActorReady, on_actor_ready)
        await bus.subscribe(self._subjects.heartbeat, Heartbeat, on_heartbeat)
        await bus.flush()
        deadline = time.monotonic() + startup_timeout
        stages = sorted({spec.stage for spec in self._specs})
        for i, stage in enumerate(stages):
            stage_specs = [spec for spec in self._specs if spec.stage == stage]
            for spec in stage_specs:
                if spec.name in self._procs:  # started held while the stage before loaded: it may go on now
                    self._release(spec)
                else:
                    self._spawn(spec)
            later = [spec for spec in self._specs if i + 1 < len(stages) and spec.stage == stages[i + 1]]
            code = await self._wait_ready(ready, {(s.role, s.rank) for s in stage_specs}, deadline,
                                          lambda: [self._spawn(spec, held=True) for spec in later
                                                   if spec.name not in self._procs])
            if code is not None:
                return code
        return None

    async def watch(self) -> int:
        """Watch the running actors until `stop` (exit code 0) or one dies or stalls (1, fail-stop)."""
        return await self._watch()

    def stop(self) -> None:
        """Make `start` or `watch` return 0 soon (call on the supervisor's event loop)."""
        self._stop.set()

    async def close(self, drain: bool = True) -> None:
        """Stop every actor and close the bus connection: draining along the ring (`_terminate_all`), or, after
        a fail-stop (`drain` False), all at once, so every open stream ends with its error now."""
        if drain:
            self._terminate_all()
        else:
            self._stop_all_now()
        if self._bus is not None:
            bus, self._bus = self._bus, None
            await bus.close()

    def pids(self) -> dict[str, int]:
        """Actor name (`scheduler0`, ...) -> process id, for the actors started."""
        return {name: proc.pid for name, proc in self._procs.items()}

    def _spawn(self, spec: ActorSpec, held: bool = False) -> None:
        """Start `spec`'s process; `held`: it imports its code, then waits for `_release` (runtime.HOLD_ENV)."""
        argv = [sys.executable, "-m", spec.module, "--nats-url", self._nats_url,
                "--namespace", self._subjects.namespace, *spec.args]
        # secrets meant for one role stay out of the others' environments
        env = {k: v for k, v in os.environ.items() if k not in ROLE_SECRETS or spec.role in ROLE_SECRETS[k]}
        if held:
            env[HOLD_ENV] = "1"
        # every actor writes to the launcher's terminal: a redrawn progress bar (tqdm's, as transformers draws one
        # converting a GGUF) would corrupt the other actors' log lines, so actors show progress as log lines only
        env["TQDM_DISABLE"] = "1"
        # own session: a terminal's Ctrl-C reaches only the launcher, which then stops actors in order
        self._procs[spec.name] = subprocess.Popen(argv, stdin=subprocess.PIPE if held else subprocess.DEVNULL,
                                                  preexec_fn=die_with_parent, start_new_session=True, env=env)
        log_event(log, logging.INFO, "started actor", actor=spec.name, pid=self._procs[spec.name].pid,
                  **({"held": "until the stage before is ready"} if held else {}))

    def _release(self, spec: ActorSpec) -> None:
        """Let an actor started held go on (a line on its stdin); one that died meanwhile is found by the caller."""
        proc = self._procs[spec.name]
        try:
            assert proc.stdin is not None
            proc.stdin.write(b"go\n")
            proc.stdin.close()
        except OSError:  # it is gone: `_wait_ready` says so
            return
        log_event(log, logging.INFO, "released actor", actor=spec.name, pid=proc.pid)

    def _dead_actor(self) -> str | None:
        for name, proc in {**self._watched, **self._procs}.items():
            if proc.poll() is not None:
                return describe_exit(name, proc.pid, proc.returncode)
        return None

    async def _wait_ready(self, ready: set[tuple[str, int]], wanted: set[tuple[str, int]], deadline: float,
                          prestart: Callable[[], object] | None = None) -> int | None:
        """None once every actor of `wanted` is ready, else the exit code. `prestart` is called once at most one
        of them is still not ready (the stage's slowest, the scheduler loading its model): the next stage's
        processes then import their code beside it, held (`_spawn`), off the start-up's critical path."""
        while not wanted <= ready:
            if prestart is not None and len(wanted - ready) <= 1:
                prestart()
                prestart = None
            if self._stop.is_set():
                return 0
            dead = self._dead_actor()
            if dead is not None:
                log_event(log, logging.ERROR, f"{dead} during startup; stopping ringserve")
                return 1
            if time.monotonic() > deadline:
                missing = ", ".join(f"{r}{k}" for r, k in sorted(wanted - ready))
                log_event(log, logging.ERROR, f"not ready in time: {missing}; stopping ringserve")
                return 1
            await asyncio.sleep(0.1)
        return None

    async def _watch(self) -> int:
        while not self._stop.is_set():
            self._respawn_due()
            for name, why in self._failures():
                await self._announce_gone(name, why)
                if not self._restart(name, why):
                    log_event(log, logging.ERROR, f"{why}; stopping every actor (fail-stop)")
                    return 1
            while self._gone_later:
                name, pid, why = self._gone_later.pop(0)
                await self._announce_gone(name, why, pid)
            try:
                await asyncio.wait_for(self._stop.wait(), timeout=0.2)
            except asyncio.TimeoutError:
                pass
        log_event(log, logging.INFO, "shutting down")
        return 0

    async def _announce_gone(self, name: str, why: str, pid: int | None = None) -> None:
        """Publish `ActorGone` for actor `name`'s process (`pid`, default: the running one's; a stalled one is
        killed first, so it is gone when said)."""
        spec = next((s for s in self._specs if s.name == name), None)
        proc = self._procs.get(name) if pid is None else None
        if spec is None or self._bus is None or (pid is None and proc is None):
            return
        if proc is not None:
            if proc.poll() is None:  # stalled: it would be killed next anyway; its streams end now
                proc.kill()
                proc.wait()
            pid = proc.pid
        assert pid is not None
        try:
            await self._bus.publish(self._subjects.gone, ActorGone(spec.role, spec.rank, pid, why))
            await self._bus.flush()
        except Exception as exc:  # the entry still notices the silence
            log_event(log, logging.WARNING, "could not announce a gone actor", actor=name, error=repr(exc))

    def _failures(self) -> list[tuple[str, str]]:
        """(actor name, what happened) for every actor that died or stalled."""
        now = time.monotonic()
        out = [(name, describe_exit(name, proc.pid, proc.returncode))
               for name, proc in {**self._watched, **self._procs}.items() if proc.poll() is not None]
        out += [(name, f"actor {name} sent no heartbeat for {now - seen:.1f} s (stalled)")
                for name, seen in self._last_beat.items()
                if now - seen > self._watchdog_timeout and name in self._procs and all(name != n for n, _ in out)]
        return out

    def _restart(self, name: str, why: str) -> bool:
        """Start a failed actor of a role in RESTARTABLE_ROLES again (after a backoff) while another actor of its
        role runs; False when it is of another role, or the last of its (fail-stop stays the rule then)."""
        specs = {s.name: s for s in self._specs}
        spec = specs.get(name)
        if spec is None or spec.role not in RESTARTABLE_ROLES:
            return False
        if name not in self._procs:  # already stopped with its group this round
            return True
        # an actor of a group (the ranks of a `--tp` replica) goes down and comes back with all of its group
        members = [s.name for s in self._specs if spec.group and s.group == spec.group] or [name]
        others = [n for n, p in self._procs.items()
                  if n not in members and n in specs and specs[n].role == spec.role and p.poll() is None]
        if not others:
            return False
        for member in members:
            proc = self._procs.pop(member, None)
            if proc is not None and member != name:  # a group's rank 0 first ends its requests with errors
                try:
                    proc.wait(timeout=GROUP_EXIT_GRACE)
                except subprocess.TimeoutExpired:
                    pass
            if proc is not None and proc.poll() is None:  # stalled, or a group member: it holds memory and ports
                proc.kill()
                proc.wait()
            if proc is not None and member != name:
                self._gone_later.append((member, proc.pid, f"stopped with {name}, of its group"))
            self._last_beat.pop(member, None)
        count = self.restarts[name] = self.restarts.get(name, 0) + 1
        delay = min(RESTART_BACKOFF_MAX, RESTART_BACKOFF * 2 ** (count - 1))
        for member in members:
            self._respawn_at[member] = time.monotonic() + delay
        log_event(log, logging.ERROR, f"{why}; the other {spec.role}s serve, restarting it", actor=name,
                  restart=count, in_s=delay)
        return True

    def _respawn_due(self) -> None:
        now = time.monotonic()
        for name, at in list(self._respawn_at.items()):
            if now >= at:
                del self._respawn_at[name]
                self._spawn(next(s for s in self._specs if s.name == name))

    def _terminate_all(self) -> None:
        """Stop the actors wave by wave along the ring, each wave once the one before exited (SIGTERM: each
        drains, see actors/common/runtime.py): the entry and tokenizers take nothing new and finish handing
        over, then the schedulers finish what they run, then the detokenizers and the rest, which by then hold
        nothing. Whoever still runs STOP_DRAIN_SECONDS after the start gets a second SIGTERM (stop at once),
        and is killed at STOP_GRACE_SECONDS. A second Ctrl-C (or SIGTERM) meanwhile stops every actor at once."""
        start = time.monotonic()
        roles = {spec.name: spec.role for spec in self._specs}
        waves = [[name for name in self._procs if roles.get(name) in wave] for wave in SHUTDOWN_WAVES]
        waves.append([name for name in self._procs if not any(name in wave for wave in waves)])
        hurry: list[bool] = []
        signalled: set[str] = set()

        def stop_all_now(signum: int, frame: object) -> None:  # runs between the waits below
            if not hurry:
                log_event(log, logging.WARNING, "second signal: stopping every actor at once")
            hurry.append(True)
            for name, proc in self._procs.items():
                # a second stop signal stops without draining; one not signalled yet gets two different ones
                # (two of the same signal may merge into one while pending)
                for sig in ((signal.SIGTERM,) if name in signalled else (signal.SIGINT, signal.SIGTERM)):
                    if proc.poll() is None:
                        proc.send_signal(sig)
                signalled.add(name)

        previous = _install({signal.SIGINT: stop_all_now, signal.SIGTERM: stop_all_now})
        try:
            for wave in waves:
                for name in wave:
                    if self._procs[name].poll() is None and name not in signalled:
                        signalled.add(name)
                        self._procs[name].send_signal(signal.SIGTERM)
                for name in wave:
                    self._await_exit(name, start)
        finally:
            _install(previous)

    def _stop_all_now(self) -> None:
        """Every actor stops without draining (SIGINT then SIGTERM: two stop signals), killed after the grace."""
        for proc in self._procs.values():
            for sig in (signal.SIGINT, signal.SIGTERM):
                if proc.poll() is None:
                    proc.send_signal(sig)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for name, proc in self._procs.items():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log_event(log, logging.WARNING, "actor did not stop in time; killing it", actor=name)
                proc.kill()
                proc.wait()

    def _await_exit(self, name: str, start: float) -> None:
        """Wait for actor `name` to exit: a second SIGTERM at STOP_DRAIN_SECONDS, SIGKILL at STOP_GRACE_SECONDS."""
        proc = self._procs[name]
        try:
            proc.wait(timeout=max(0.0, start + STOP_DRAIN_SECONDS - time.monotonic()))
            return
        except subprocess.TimeoutExpired:
            log_event(log, logging.WARNING, "actor still draining; stopping it at once", actor=name)
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=max(0.1, start + STOP_GRACE_SECONDS - time.monotonic()))
        except subprocess.TimeoutExpired:
            log_event(log, logging.WARNING, "actor did not stop in time; killing it", actor=name)
            proc.kill()
            proc.wait()


def _install(handlers: dict[signal.Signals, object]) -> dict[signal.Signals, object]:
    """Set these signal handlers (only the main thread may: elsewhere, e.g. `ringserve.Engine`'s loop thread,
    nothing changes); the ones they replace."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}  # type: ignore[arg-type]
