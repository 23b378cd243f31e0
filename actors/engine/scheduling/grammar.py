"""Constrained requests in the engine: their grammars compiled off the step path, their matchers, their masks.

A request with an output constraint (`SamplingParams.grammar`: a JSON schema, regex or EBNF grammar) does not
wait in the prefill queue until its grammar is compiled: `submit` starts the compilation on the backend's
thread pool (cached per constraint, so repeated schemas cost microseconds) and `collect` hands the request on
once it is ready, or fails it when the grammar is invalid, too large or took more than `compile_timeout` CPU
seconds to compile. No step ever waits for a compilation; when nothing else can run, `wait` sleeps until one
finishes. The compiler itself (xgrammar, and transformers' tokenizer that it reads) is made on a thread of its
own with the first constrained request, so no step waits for that either. The compilation itself runs in a
compile worker process capped in memory and killed past `compile_timeout` CPU seconds
(kernels/grammar/compile_pool.py, which also bounds its wall time), so no grammar can grow the scheduler's
memory or keep its request waiting without end. Making the compiler and queueing for a worker do not count
against a request: on a busy host they can take longer than the compile itself.

Each admitted constrained request owns a `GrammarMatcher` (`Req.matcher`). Before sampling, `bitmask` fills
one packed row per constrained sampling row from its matcher; the sampler masks those rows only, so
unconstrained rows in the same batch are untouched. The sampled token goes back into the matcher when the
step is applied (`accept`), which is why a constrained request needs its previous token applied before its
next mask: the overlap loop applies the step in flight first when one of its requests is constrained.
Jump-forward (`forced_tokens`, applied by actors/engine/scheduling/jump_forward.py): where the grammar admits exactly one
continuation, its tokens are appended at once, and the request computes them in one extend step instead of one
decode step each.

A reasoning request (`Req.gate`, actors/engine/scheduling/reasoning_gate.py) is constrained only once it answers:
while it thinks its tokens bypass the matcher and its rows are masked only to force a marker token (the budget
spent, or the rest of a several-token start marker) or, before its first token, to let it open the thinking
where the grammar would not. It counts as constrained for the overlap loop until it answers, since its phase
follows its previous token.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Sequence
from typing import Any

import torch

from ringserve.actors.engine.scheduling.reasoning_gate import Spacing, whitespace_tokens
from ringserve.actors.engine.scheduling.request import Req
from ringserve.bus.errors import ApiError, server_error
from ringserve.kernels.grammar import GrammarCompiler, GrammarError, GrammarSpec, allocate_bitmask

log = logging.getLogger("engine.grammar")


class GrammarManager:
    """Compiles constrained requests' grammars and keeps what they need per step."""

    def __init__(self, tokenizer: Any, vocab_size: int, compile_timeout: float) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self.compile_timeout = compile_timeout
        self._compiler: concurrent.futures.Future[GrammarCompiler] | None = None
        self.pending: dict[str, tuple[Req, concurrent.futures.Future[Any]]] = {}
        self._spacing: Spacing | None = None

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
        if self._compiler is None:
            # the first constrained request makes the compiler (xgrammar and transformers' tokenizer, which it
            # reads: seconds) on a thread of its own, so no step waits for that either
            setup = concurrent.futures.ThreadPoolExecutor(1, "grammar-setup")
            self._compiler = setup.submit(self._make_compiler)
            setup.shutdown(wait=False)  # the thread ends when the compiler is made
        self.pending[req.rid] = (req, _then_compile(self._compiler, GrammarSpec(kind, source)))
        return None

    def _make_compiler(self) -> GrammarCompiler:
        from ringserve.actors.common.text_tokenizer import transformers_tokenizer
        from ringserve.kernels.grammar import make_compiler

        # a worker overrunning its CPU limit is killed, so a runaway compile stops costing CPU and memory then
        return make_compiler(transformers_tokenizer(self._tokenizer), self._vocab_size,
                             time_limit=self.compile_timeout)

    def collect(self) -> tuple[list[Req], list[tuple[Req, ApiError]]]:
        """Requests whose grammar is compiled (each with its matcher), and those that failed, with why."""
        ready: list[Req] = []
        failed: list[tuple[Req, ApiError]] = []
        for rid, (req, future) in list(self.pending.items()):
            if future.done():
                del self.pending[rid]
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
        return self.pending.pop(req.rid, None) is not None

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


def _then_compile(compiler: concurrent.futures.Future[GrammarCompiler],
                  spec: GrammarSpec) -> concurrent.futures.Future[Any]:
    """A future of `spec` compiled once `compiler` is made (at once when it is); its error when it failed."""
    out: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def copy(done: concurrent.futures.Future[Any]) -> None:
        error = done.exception()
        if error is not None:
            out.set_exception(error)
        else:
            out.set_result(done.result())

    def compile_with(made: concurrent.futures.Future[GrammarCompiler]) -> None:
        if made.exception() is not None:
            copy(made)
        else:
            made.result().compile_async(spec).add_done_callback(copy)

    compiler.add_done_callback(compile_with)
    return out
