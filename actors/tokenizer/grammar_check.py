"""The tokenizer's check of a request's output constraint (JSON schema, regex, EBNF, structural tag) before
admission.

The constraint is parsed by the same grammar backend the engine compiles it with (`ringserve.kernels.grammar`), so an
invalid one is a 400 naming its parameter and never reaches the scheduler. Parsing is cached per constraint
and runs off the event loop, in the backend's compile worker process (bounded in memory and time, and what
xgrammar prints about a client's grammar never reaches this actor's log raw). With `--grammar-warm-up` (on by
default) the backend is loaded and its worker warmed as the tokenizer starts (`warm_up`: the worker process is
started first thing, compile_pool's `prestart`, and a tiny schema checked once the compiler is made), and the
tokenizer's ready waits for that (`wait_warm`, at most `WARM_READY_SECONDS`), which on a ring is hidden behind
the scheduler's weight load; without it the first constrained request loads it, also off the event loop. The
checker's view of the vocabulary is cached per model (actors/common/grammar_vocab.py): after the first start,
transformers' tokenizer is not loaded for it. A
request whose check took longer than `WAIT_NOTE_SECONDS` because the checker was being made says so in one log
line with its rid.

A `structural_tag` in a request with OpenAI names can only be the lazy grammar of `tool_choice: "auto"` (OpenAI
bodies cannot set the parameter): its errors name `tools`, and a tag this model's vocabulary cannot enter (its
trigger is one of the model's special tokens, `UnreachableTag`) is dropped, leaving the output unconstrained as
it would be without the grammar. A native request's tag is refused then, naming `structural_tag`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from typing import Any

from ringserve.bus.errors import ApiError
from ringserve.bus.params import SamplingParams
from ringserve.observability.logging import log_event

log = logging.getLogger("tokenizer.grammar")
WAIT_NOTE_SECONDS = 1.0  # a check that waited longer than this for the checker to be made says so
WARM_READY_SECONDS = 30.0  # the most the tokenizer's ready waits for the warm-up (`wait_warm`)
WARM_SCHEMA = '{"type": "object", "properties": {"a": {"type": "string"}}}'  # checked once to load the parser


class GrammarChecker:
    """Checks `SamplingParams.grammar` with a compiler for the model's tokenizer and vocabulary."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._compiler: Any = None
        self._lock = threading.Lock()
        self._warm: concurrent.futures.Future[str] | None = None

    def warm_up(self) -> concurrent.futures.Future[str]:
        """Make the compiler (and its worker) and check a tiny schema now, on a thread of its own: a future of
        "warm", or of why not ("failed: ..."). Calling it again returns the same future."""
        if self._warm is None:
            self._warm = concurrent.futures.Future()
            threading.Thread(target=self._warm_checker, args=(self._warm,), name="grammar-check-warm",
                             daemon=True).start()
        return self._warm

    def wait_warm(self, timeout: float = WARM_READY_SECONDS) -> str:
        """Block until the warm-up is done, at most `timeout` seconds: "warm", "warming", "cold" (none asked
        for) or why not."""
        if self._warm is None:
            return "cold"
        concurrent.futures.wait([self._warm], timeout=timeout)
        return self._warm.result() if self._warm.done() else "warming"

    def _warm_checker(self, warm: concurrent.futures.Future[str]) -> None:
        from ringserve.kernels.grammar import GrammarSpec

        started = time.monotonic()
        try:
            self._compiler_for().check(GrammarSpec("json_schema", WARM_SCHEMA))
        except Exception as exc:  # the first request tries again (and fails with the reason if it must)
            log_event(log, logging.WARNING, "warming the grammar checker failed", error=repr(exc)[:300])
            warm.set_result(f"failed: {exc!r}"[:300])
            return
        log_event(log, logging.INFO, "grammar checker warm", seconds=round(time.monotonic() - started, 2))
        warm.set_result("warm")

    async def check(self, params: SamplingParams, openai_names: bool, rid: str = "") -> None:
        """ApiError 400 naming the constraint's parameter (`response_format` for an OpenAI body's JSON schema,
        `tools` for its lazy tool-call grammar) when it does not parse. Drops (sets to None) the lazy tool-call
        grammar of an OpenAI body when this model cannot enter it."""
        grammar = params.grammar
        if grammar is None:
            return
        from ringserve.kernels.grammar import GrammarError, GrammarSpec, UnreachableTag

        kind, source = grammar
        try:
            spec = GrammarSpec(kind, source)
            await asyncio.to_thread(lambda: self._timed_compiler(rid).check(spec))
        except UnreachableTag as exc:
            if not openai_names:
                raise ApiError(str(exc)[:1000], param=kind) from exc
            log.debug("tool_choice auto left unconstrained: %s", exc)
            params.structural_tag = None
        except GrammarError as exc:
            message = str(exc)
            if openai_names and kind == "structural_tag":  # the client sent tools, not a structural tag
                detail = message.removeprefix("invalid structural tag: ").removeprefix("its JSON schema: ")
                message = f"a tool's parameters schema cannot be enforced (tool_choice auto enforces it): {detail}"
            raise ApiError(message[:1000], param=_param(kind, openai_names)) from exc

    def _timed_compiler(self, rid: str) -> Any:
        """`_compiler_for`, saying so with `rid` when the request waited for the checker to be made."""
        if self._compiler is not None:
            return self._compiler
        started = time.monotonic()
        compiler = self._compiler_for()
        waited = time.monotonic() - started
        if waited > WAIT_NOTE_SECONDS:
            log_event(log, logging.INFO, "constrained request waited for its grammar check", rid=rid,
                      waited_s=round(waited, 2), waited_for="the checker being made",
                      warm_up="warming" if self._warm is not None else "cold")
        return compiler

    def _compiler_for(self) -> Any:
        with self._lock:  # two first requests at once make one compiler (and one worker process)
            return self._make_once()

    def _make_once(self) -> Any:
        if self._compiler is None:
            from ringserve.actors.common.grammar_vocab import grammar_compiler

            self._compiler = grammar_compiler(self._tokenizer, self._vocab_size, compile_threads=1)
        return self._compiler


def _param(kind: str, openai_names: bool) -> str:
    """The parameter a constraint's error names: the native one, or the field an OpenAI body set it with."""
    if openai_names and kind == "json_schema":
        return "response_format"
    if openai_names and kind == "structural_tag":
        return "tools"
    return kind
