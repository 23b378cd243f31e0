"""Constrained requests in the engine: their grammars compiled off the step path, their matchers, their masks.

A request with an output constraint (`SamplingParams.grammar`: a JSON schema, regex or EBNF grammar) does not
wait in the prefill queue until its grammar is compiled: `submit` starts the compilation on the backend's
thread pool (cached per constraint, so repeated schemas cost microseconds) and `collect` hands the request on
once it is ready, or fails it when the grammar is invalid, too large or took more than `compile_timeout` CPU
seconds to compile. No step ever waits for a compilation; when nothing else can run, `wait` sleeps until one
finishes. The compilation itself runs in a compile worker process capped in memory and killed past
`compile_timeout` CPU seconds (kernels/grammar/compile_pool.py, which also bounds its wall time), so no grammar
can grow the scheduler's memory or keep its request waiting without end. Making the compiler and queueing for a
worker do not count against a request: on a busy host they can take longer than the compile itself.

Warm-up (`--grammar-warm-up`, on by default; the test suite's many rings turn it off, since each compile
worker holds about 200 MB): making the compiler (xgrammar, transformers' tokenizer that it reads, the tokenizer
info: about 10 s of CPU on a loaded 2-core host; from the second start on, the tokenizer info is read from
ringserve's cache instead, actors/common/grammar_vocab.py) and starting a compile worker (a process that imports torch
and xgrammar: 4 s) made lazily fell on the first constrained request, and every chat with tools is one (its
lazy tool-call grammar). So the scheduler starts the worker process first thing (compile_pool's `prestart`)
and a manager of its own for the model's tokenizer, warming (`warm_up`) on a thread of its own while the
weights load, off the step path; one tiny grammar (`json_object`) is compiled to load the rest, and the engine's
manager takes that compiler over once it is built (`adopt`). The scheduler's `ready` waits for that
(`wait_warm`), at most `WARM_READY_SECONDS`, and its ready detail says `grammars: warm` (or "warming" past the
bound). Waiting is the faster start for a
client: the entry opens its port only once the scheduler is ready, so a warm-up behind `ready` would overlap
little but the entry's start, and the first request would then wait for it instead (a "ready" ring that is not).
Before `ready` it runs beside the weights' load, the tokenizer's and detokenizer's start and the decode graphs'
background compile. Past the bound `ready` goes out anyway (an overloaded host is not held for minutes) and the
first request waits for the rest, saying so. The other worker (one per compile thread) is started only when two
compiles come together (and that start is logged): a second warm worker would hold its memory for a case most
rings never meet. Without a warm-up the first constrained request makes the compiler, and says so in the log
and on its trace.

A request whose grammar took longer than `WAIT_NOTE_SECONDS` (for the compiler, a worker or its compile) says so
in one log line with its rid and where the time went, and through `on_wait` (the scheduler's request spans: an
event on its trace).

Each admitted constrained request owns a `GrammarMatcher` (`Req.matcher`). Before sampling, `bitmask` fills
one packed row per constrained sampling row from its matcher; the sampler masks those rows only, so
unconstrained rows in the same batch are untouched. The sampled token goes back into the matcher when the
step is applied (`accept`), which is why a constrained request needs its previous token applied before its
next mask: the overlap loop applies the step in flight first when one of its requests is constrained.
Jump-forward (`forced_tokens`, applied by actors/engine/scheduling/jump_forward.py): where the grammar admits exactly one
continuation, its tokens are appended at once, and the request computes them in one extend step instead of one
decode step each.

A reasoning request (`Req.gate`, actors/engine/core/reasoning_gate.py) is constrained only once it answers:
while it thinks its tokens bypass the matcher and its rows are masked only to force a marker token (the budget
spent, or the rest of a several-token start marker) or, before its first token, to let it open the thinking
where the grammar would not. It counts as constrained for the overlap loop until it answers, since its phase
follows its previous token.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ringserve.actors.engine.core.reasoning_gate import Spacing, whitespace_tokens
from ringserve.actors.engine.core.request import Req
from ringserve.bus.errors import ApiError, server_error
from ringserve.kernels.grammar import GrammarCompiler, GrammarError, GrammarSpec, allocate_bitmask
from ringserve.observability.logging import log_event

log = logging.getLogger("engine.grammar")
WAIT_NOTE_SECONDS = 1.0  # a request whose grammar took longer than this says why (log line, `on_wait`)
WARM_READY_SECONDS = 30.0  # the most the scheduler's ready waits for the warm-up (`wait_warm`)


@dataclass
class _Timing:
    """When a request asked for its grammar, when its compiler was there, and when the grammar was
    (time.monotonic)."""

    submitted: float
    compiler_at: float | None = None
    done_at: float | None = None


class GrammarManager:
    """Compiles constrained requests' grammars and keeps what they need per step."""

    def __init__(self, tokenizer: Any, vocab_size: int, compile_timeout: float) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self.compile_timeout = compile_timeout
        self._compiler: concurrent.futures.Future[GrammarCompiler] | None = None
        self.pending: dict[str, tuple[Req, concurrent.futures.Future[Any]]] = {}
        self._timings: dict[str, _Timing] = {}
        self._warm: concurrent.futures.Future[str] | None = None
        self._spacing: Spacing | None = None
        # told `(rid, where its time went)` of a request that waited for its grammar (on the engine's thread)
        self.on_wait: Callable[[str, dict[str, Any]], None] | None = None

    def spacing(self) -> Spacing | None:
        """The vocabulary's whitespace-only tokens (found once, on first use), which a reasoning request's
        constrained answer may open with (reasoning_gate.py); None without a tokenizer."""
        if self._spacing is None and self._tokenizer is not None:
            self._spacing = whitespace_tokens(self._tokenizer, self._vocab_size)
        return self._spacing

    def __len__(self) -> int:
        return len(self.pending)

    def submit(self, req: Req) -> ApiError | None:
        """Start compiling `req`'s grammar; an error when this engine cannot constrain output at all."""
        kind, source = req.params.grammar  # type: ignore[misc]  # only constrained requests come here
        if self._tokenizer is None:
            return server_error("output constraints need a tokenizer, and this engine has none")
        timing = self._timings[req.rid] = _Timing(time.monotonic())
        self.pending[req.rid] = (req, _then_compile(self._start_compiler(), GrammarSpec(kind, source), timing))
        return None

    def warm_up(self) -> concurrent.futures.Future[str]:
        """Make the compiler and warm it now, off the step path (the module's docstring): a future of "warm", or
        of why not ("failed: ...", "off: ..."). Calling it again returns the same future."""
        if self._warm is None:
            self._warm = concurrent.futures.Future()
            if self._tokenizer is None:
                self._warm.set_result("off: this engine has no tokenizer")
            else:
                threading.Thread(target=self._warm_compiler, args=(self._start_compiler(), self._warm),
                                 name="grammar-warm", daemon=True).start()
        return self._warm

    def warm_state(self) -> str:
        """"warm", "warming", "cold" (no warm-up asked for), or why not ("failed: ...", "off: ...")."""
        if self._warm is None:
            return "cold"
        return self._warm.result() if self._warm.done() else "warming"

    def adopt(self, early: GrammarManager) -> bool:
        """Take over `early`'s compiler and warm-up: a manager for the same tokenizer made before this one (the
        scheduler warms one while the weights load). False, leaving `early` alone, where this one has a compiler
        already or the vocabularies differ."""
        if self._compiler is not None or early._compiler is None or early._vocab_size != self._vocab_size:
            return False
        self._compiler, self._warm = early._compiler, early._warm
        return True

    def close(self) -> None:
        """Close the compiler once it is made, and with it its compile worker processes (an early manager the
        engine's could not take over)."""
        if self._compiler is not None:
            self._compiler.add_done_callback(lambda made: made.exception() is None and made.result().close())

    def wait_warm(self, timeout: float = WARM_READY_SECONDS) -> str:
        """Block until the warm-up is done, at most `timeout` seconds; `warm_state()` then."""
        if self._warm is not None:
            concurrent.futures.wait([self._warm], timeout=timeout)
        return self.warm_state()

    def _start_compiler(self) -> concurrent.futures.Future[GrammarCompiler]:
        if self._compiler is None:
            # xgrammar and transformers' tokenizer, which it reads: seconds, on a thread of its own
            setup = concurrent.futures.ThreadPoolExecutor(1, "grammar-setup")
            self._compiler = setup.submit(self._make_compiler)
            setup.shutdown(wait=False)  # the thread ends when the compiler is made
        return self._compiler

    @staticmethod
    def _warm_compiler(compiler: concurrent.futures.Future[GrammarCompiler],
                       warm: concurrent.futures.Future[str]) -> None:
        started = time.monotonic()
        try:
            made = compiler.result()
            made_s = time.monotonic() - started
            made.warm_up()
        except Exception as exc:  # the first request tries again (and fails with the reason if it must)
            log_event(log, logging.WARNING, "warming the grammar compiler failed", error=repr(exc)[:300])
            warm.set_result(f"failed: {exc!r}"[:300])
            return
        log_event(log, logging.INFO, "grammar compiler warm", seconds=round(time.monotonic() - started, 2),
                  compiler_s=round(made_s, 2))
        warm.set_result("warm")

    def _make_compiler(self) -> GrammarCompiler:
        from ringserve.actors.common.grammar_vocab import grammar_compiler

        # a worker overrunning its CPU limit is killed, so a runaway compile stops costing CPU and memory then
        return grammar_compiler(self._tokenizer, self._vocab_size, time_limit=self.compile_timeout)

    def collect(self) -> tuple[list[Req], list[tuple[Req, ApiError]]]:
        """Requests whose grammar is compiled (each with its matcher), and those that failed, with why."""
        ready: list[Req] = []
        failed: list[tuple[Req, ApiError]] = []
        for rid, (req, future) in list(self.pending.items()):
            if future.done():
                del self.pending[rid]
                self._note_wait(rid, self._timings.pop(rid, None))
                try:
                    req.matcher = future.result().matcher()
                    ready.append(req)
                except GrammarError as exc:
                    failed.append((req, ApiError(str(exc)[:1000], param=exc.kind or req.params.grammar[0])))
                except Exception as exc:  # a backend bug ends this request only
                    log.exception("compiling the grammar of %s failed", rid)
                    failed.append((req, server_error(f"compiling the output constraint failed: {exc!r}"[:1000])))
        return ready, failed

    def remove(self, req: Req) -> bool:
        """Forget a request still compiling (an abort); False if it is not here."""
        self._timings.pop(req.rid, None)
        return self.pending.pop(req.rid, None) is not None

    def _note_wait(self, rid: str, timing: _Timing | None) -> None:
        """Say where the time went (log, `on_wait`) when `rid` waited longer than WAIT_NOTE_SECONDS."""
        if timing is None:
            return
        done = timing.done_at if timing.done_at is not None else time.monotonic()
        if done - timing.submitted <= WAIT_NOTE_SECONDS:
            return
        compiler_at = timing.compiler_at if timing.compiler_at is not None else done
        compiler_s, compile_s = compiler_at - timing.submitted, done - compiler_at
        fields: dict[str, Any] = {
            "waited_s": round(done - timing.submitted, 2),
            "waited_for": "the compiler being made" if compiler_s >= compile_s
            else "a compile worker or the compile itself",
            "compiler_s": round(compiler_s, 2), "compile_s": round(compile_s, 2), "warm_up": self.warm_state()}
        log_event(log, logging.INFO, "constrained request waited for its grammar", rid=rid, **fields)
        if self.on_wait is not None:
            try:
                self.on_wait(rid, fields)
            except Exception:  # the trace's loss, never the step's
                log.exception("noting the grammar wait of %s failed", rid)

    def wait(self, timeout: float) -> None:
        """Block until a compilation finishes, at most `timeout` seconds (when nothing else can run)."""
        if self.pending:
            concurrent.futures.wait([f for _, f in self.pending.values()], timeout=timeout,
                                    return_when=concurrent.futures.FIRST_COMPLETED)

    def bitmask(self, reqs: Sequence[Req], drafted: Sequence[Sequence[int]] = ()) -> tuple[torch.Tensor,
                                                                                             list[int]] | None:
        """The packed masks of the constrained ones among a step's sampling rows `reqs`, and their row
        indices; None when no row is constrained (the common case costs one scan). `drafted[i]`: the draft
        tokens before row `i` of a verifying request (speculative decoding), which its mask follows (accepted
        into the matcher for the fill, then rolled back). A reasoning request's row is masked only where its
        gate says (`ReasoningGate.masks`), and never has drafts."""
        rows = [i for i, req in enumerate(reqs)
                if (req.matcher is not None if req.gate is None else req.gate.masks(req.matcher is not None))]
        if not rows:
            return None
        mask = allocate_bitmask(len(reqs), self._vocab_size)
        for i in rows:
            matcher, gate = reqs[i].matcher, reqs[i].gate
            if gate is not None:
                gate.fill_bitmask(matcher, mask, i)
                continue
            before = drafted[i] if drafted else ()
            for token in before:  # valid: the drafts were cut at the first token the grammar refuses
                matcher.accept_token(token)  # type: ignore[union-attr]
            matcher.fill_bitmask(mask, i)  # type: ignore[union-attr]
            if before:
                matcher.rollback(len(before))  # type: ignore[union-attr]
        return mask, rows

    @staticmethod
    def valid_prefix(req: Req, tokens: list[int]) -> list[int]:
        """The longest prefix of draft `tokens` that `req`'s grammar admits next (all of them unconstrained);
        the matcher is left as it was."""
        matcher = req.matcher
        if matcher is None:
            return tokens
        if matcher.is_terminated():
            return []
        n = 0
        while n < len(tokens) and matcher.accept_token(tokens[n]):
            n += 1
        if n:
            matcher.rollback(n)
        return tokens[:n]

    @staticmethod
    def accept(req: Req, token: int) -> bool:
        """Advance `req`'s matcher past its sampled `token` (a reasoning request's gate first: its thinking
        bypasses the matcher); False when the grammar rejects it, or it is not the marker token forced."""
        gate = req.gate
        if gate is not None:
            fed = gate.feed(token)
            if gate.answering:
                req.gate = None  # from now on an ordinary request, constrained or not
            if fed != "answer":
                return fed == "taken"
        return req.matcher is None or req.matcher.accept_token(token)

    @staticmethod
    def forced_tokens(req: Req, room: int) -> list[int]:
        """Up to `room` tokens the grammar forces next (jump-forward), already accepted by the matcher; none
        before the request answers."""
        if (req.matcher is None or req.gate is not None or room <= 0 or req.params.return_logprob
                or req.matcher.is_terminated()):
            return []
        forced = req.matcher.jump_forward_tokens()[:room]
        for n, token in enumerate(forced):
            if not req.matcher.accept_token(token):
                req.matcher.rollback(n)
                return []
        return forced


def _then_compile(compiler: concurrent.futures.Future[GrammarCompiler], spec: GrammarSpec,
                  timing: _Timing) -> concurrent.futures.Future[Any]:
    """A future of `spec` compiled once `compiler` is made (at once when it is); its error when it failed.
    `timing` is told when the compiler was there and when the grammar was."""
    out: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def copy(done: concurrent.futures.Future[Any]) -> None:
        timing.done_at = time.monotonic()
        error = done.exception()
        if error is not None:
            out.set_exception(error)
        else:
            out.set_result(done.result())

    def compile_with(made: concurrent.futures.Future[GrammarCompiler]) -> None:
        timing.compiler_at = time.monotonic()
        if made.exception() is not None:
            copy(made)
        else:
            made.result().compile_async(spec).add_done_callback(copy)

    compiler.add_done_callback(compile_with)
    return out
