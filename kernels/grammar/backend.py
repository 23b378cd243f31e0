"""The contract a grammar backend implements: its `GrammarCompiler` (checking and compiling specs, with the LRU
cache and compile thread pool every backend shares), the `CompiledGrammar` it makes of a spec, and the per-request
`GrammarMatcher` that fills its row of the token bitmask."""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ringserve.kernels.grammar.spec import GrammarError, GrammarSpec


class GrammarMatcher(ABC):
    """One request's position in its grammar. Not thread-safe: use it from one thread at a time."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by `token_id`; False (state unchanged) if the grammar does not allow it here.

        Accepting a stop token once the grammar is complete terminates the matcher.
        """

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into host `bitmask[row]` (a terminated matcher allows only stops)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """Whether a stop token has been accepted: nothing more can follow."""

    @abstractmethod
    def is_completed(self) -> bool:
        """Whether the text so far is a complete match (a stop token would be accepted now)."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (at most `len(accepted_tokens)`)."""

    @abstractmethod
    def jump_forward(self) -> str:
        """The text the grammar forces from here (jump-forward decoding); "" when nothing is forced.

        Does not change the state. Whole UTF-8 characters only.
        """

    @abstractmethod
    def jump_forward_tokens(self) -> list[int]:
        """Token ids spelling (a prefix of) `jump_forward()`, safe to accept one by one; [] when none.

        The last token is left out when a longer token could extend it, so the tokenisation at the boundary
        stays the model's choice. This may differ from how the tokenizer would encode the same text.
        """

    @abstractmethod
    def copy(self) -> GrammarMatcher:
        """An independent matcher in the same state."""

    @abstractmethod
    def reset(self) -> None:
        """Back to the start of the grammar."""

    @property
    @abstractmethod
    def accepted_tokens(self) -> tuple[int, ...]:
        """The tokens accepted since the start (or the last reset): enough to rebuild the state."""

    @property
    @abstractmethod
    def stop_token_ids(self) -> tuple[int, ...]:
        """The tokens that end the grammar once it is complete."""


class CompiledGrammar(ABC):
    """A spec compiled against one tokenizer: immutable, shared by all requests with that spec."""

    spec: GrammarSpec
    compile_seconds: float  # how long its one compilation took (cache hits return this same object)

    @abstractmethod
    def matcher(self, accepted_tokens: Sequence[int] = ()) -> GrammarMatcher:
        """A new matcher, advanced by `accepted_tokens` (rebuilding a retracted request's state).

        Raises GrammarError if the grammar rejects one of them.
        """

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """The model's vocabulary size the masks cover (the logits' width)."""

    @property
    @abstractmethod
    def memory_bytes(self) -> int:
        """Approximate memory held by the compiled grammar."""


class GrammarCompiler(ABC):
    """Checks and compiles specs for one tokenizer, with an LRU cache and a small compile thread pool.

    Thread-safe. Failed compilations are cached too, so a repeated bad spec costs nothing the second time.
    """

    def __init__(self, *, cache_size: int = 256, compile_threads: int = 2) -> None:
        self._cache_size = max(1, cache_size)
        self._compile_threads = max(1, compile_threads)
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar | GrammarError] = OrderedDict()
        self._checked: OrderedDict[GrammarSpec, GrammarError | None] = OrderedDict()
        self._pending: dict[GrammarSpec, Future[CompiledGrammar]] = {}
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """The model's vocabulary size (mask width in tokens)."""

    @abstractmethod
    def _check(self, spec: GrammarSpec) -> None:
        """Parse `spec` without compiling token masks; raise GrammarError if it is invalid."""

    @abstractmethod
    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile `spec` (uncached); raise GrammarError if it is invalid."""

    def check(self, spec: GrammarSpec) -> None:
        """Raise GrammarError if `spec` is invalid. Cheap (parsing only, no token masks) and cached."""
        with self._lock:
            if spec in self._checked:
                self._checked.move_to_end(spec)
                error = self._checked[spec]
                if error is not None:
                    raise error
                return
            compiled = self._cache.get(spec)
        if isinstance(compiled, GrammarError):
            raise compiled
        if compiled is not None:
            return
        try:
            self._check(spec)
            error = None
        except GrammarError as exc:
            error = exc
        with self._lock:
            self._checked[spec] = error
            self._evict(self._checked)
        if error is not None:
            raise error

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar for `spec`: the cached object when there is one. Raises GrammarError."""
        with self._lock:
            cached = self._cache.get(spec)
            if cached is not None:
                self._cache.move_to_end(spec)
        if cached is None:
            started = time.perf_counter()
            try:
                cached = self._compile(spec)
                cached.compile_seconds = time.perf_counter() - started
            except GrammarError as exc:
                cached = exc
            with self._lock:
                # Two threads may compile the same spec at once: keep the first, so callers share one object.
                cached = self._cache.setdefault(spec, cached)
                self._evict(self._cache)
        if isinstance(cached, GrammarError):
            raise cached
        return cached

    def compile_async(self, spec: GrammarSpec) -> Future[CompiledGrammar]:
        """A future of `compile(spec)`, run on the compiler's thread pool (done at once on a cache hit).

        Concurrent requests for one spec share one future. A running compilation cannot be cancelled: a
        caller with a deadline should stop waiting (`future.result(timeout)`) and fail its request.
        """
        with self._lock:
            cached = self._cache.get(spec)
            if cached is not None:
                self._cache.move_to_end(spec)
                done: Future[CompiledGrammar] = Future()
                if isinstance(cached, GrammarError):
                    done.set_exception(cached)
                else:
                    done.set_result(cached)
                return done
            pending = self._pending.get(spec)
            if pending is not None:
                return pending
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._compile_threads, thread_name_prefix="grammar-compile")
            future = self._pool.submit(self.compile, spec)
            self._pending[spec] = future
        future.add_done_callback(lambda _: self._forget_pending(spec))
        return future

    def warm_up(self) -> None:
        """Compile a tiny grammar now (any JSON object, then cached like any other) so that the first request's
        compile finds the backend loaded; raises what that compile raises."""
        self.compile(GrammarSpec("json_object"))

    def start_workers(self) -> int:
        """Start every compile worker process this compiler may use at once (so compiles that come together find
        none cold); how many run then. 0: this backend compiles in-process."""
        return 0

    def cache_len(self) -> int:
        """How many compiled grammars (and cached failures) are held."""
        with self._lock:
            return len(self._cache)

    def close(self) -> None:
        """Stop the compile threads (after the queued compilations finish)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _forget_pending(self, spec: GrammarSpec) -> None:
        with self._lock:
            self._pending.pop(spec, None)

    def _evict(self, cache: OrderedDict[GrammarSpec, Any]) -> None:
        while len(cache) > self._cache_size:
            cache.popitem(last=False)


def fill_bitmasks(matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Fill `bitmask[rows[i]]` from `matchers[i]` (a few microseconds per row for SmolLM2's vocabulary)."""
    for matcher, row in zip(matchers, rows, strict=True):
        matcher.fill_bitmask(bitmask, row)
