"""The tokenizer's check of a request's output constraint (JSON schema, regex, EBNF) before admission.

The constraint is parsed by the same grammar backend the engine compiles it with (`ringserve.kernels.grammar`), so an
invalid one is a 400 naming its parameter and never reaches the scheduler. Parsing is cached per constraint
and runs off the event loop, in the backend's compile worker process (bounded in memory and time, and what
xgrammar prints about a client's grammar never reaches this actor's log raw); the backend is loaded, also off
the event loop, on the first constrained request.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from ringserve.bus.errors import ApiError
from ringserve.bus.params import SamplingParams


class GrammarChecker:
    """Checks `SamplingParams.grammar` with a compiler for the model's tokenizer and vocabulary."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._compiler: Any = None
        self._lock = threading.Lock()

    async def check(self, params: SamplingParams, openai_names: bool) -> None:
        """ApiError 400 naming the constraint's parameter (`response_format` for an OpenAI body's JSON schema)
        when it does not parse."""
        grammar = params.grammar
        if grammar is None:
            return
        from ringserve.kernels.grammar import GrammarError, GrammarSpec

        kind, source = grammar
        try:
            spec = GrammarSpec(kind, source)
            await asyncio.to_thread(lambda: self._compiler_for().check(spec))
        except GrammarError as exc:
            param = "response_format" if openai_names and kind == "json_schema" else kind
            raise ApiError(str(exc)[:1000], param=param) from exc

    def _compiler_for(self) -> Any:
        with self._lock:  # two first requests at once make one compiler (and one worker process)
            return self._make_once()

    def _make_once(self) -> Any:
        if self._compiler is None:
            from ringserve.actors.common.text_tokenizer import transformers_tokenizer
            from ringserve.kernels.grammar import make_compiler

            self._compiler = make_compiler(transformers_tokenizer(self._tokenizer), self._vocab_size, compile_threads=1)
        return self._compiler
