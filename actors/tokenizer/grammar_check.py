"""The tokenizer's check of a request's output constraint (JSON schema, regex, EBNF, structural tag) before
admission.

The constraint is parsed by the same grammar backend the engine compiles it with (`ringserve.kernels.grammar`), so an
invalid one is a 400 naming its parameter and never reaches the scheduler. Parsing is cached per constraint
and runs off the event loop, in the backend's compile worker process (bounded in memory and time, and what
xgrammar prints about a client's grammar never reaches this actor's log raw); the backend is loaded, also off
the event loop, on the first constrained request.

A `structural_tag` in a request with OpenAI names can only be the lazy grammar of `tool_choice: "auto"` (OpenAI
bodies cannot set the parameter): its errors name `tools`, and a tag this model's vocabulary cannot enter (its
trigger is one of the model's special tokens, `UnreachableTag`) is dropped, leaving the output unconstrained as
it would be without the grammar. A native request's tag is refused then, naming `structural_tag`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from ringserve.bus.errors import ApiError
from ringserve.bus.params import SamplingParams

log = logging.getLogger("tokenizer.grammar")


class GrammarChecker:
    """Checks `SamplingParams.grammar` with a compiler for the model's tokenizer and vocabulary."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._compiler: Any = None
        self._lock = threading.Lock()

    async def check(self, params: SamplingParams, openai_names: bool) -> None:
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
            await asyncio.to_thread(lambda: self._compiler_for().check(spec))
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

    def _compiler_for(self) -> Any:
        with self._lock:  # two first requests at once make one compiler (and one worker process)
            return self._make_once()

    def _make_once(self) -> Any:
        if self._compiler is None:
            from ringserve.actors.common.text_tokenizer import transformers_tokenizer
            from ringserve.kernels.grammar import make_compiler

            self._compiler = make_compiler(transformers_tokenizer(self._tokenizer), self._vocab_size, compile_threads=1)
        return self._compiler


def _param(kind: str, openai_names: bool) -> str:
    """The parameter a constraint's error names: the native one, or the field an OpenAI body set it with."""
    if openai_names and kind == "json_schema":
        return "response_format"
    if openai_names and kind == "structural_tag":
        return "tools"
    return kind
