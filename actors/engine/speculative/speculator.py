"""Which requests speculate, their drafts, and what a verify step keeps.

A request speculates unless it opted out (`speculative: false`), a `min_new_tokens` ban is still in force, or it is
a reasoning request whose constraint or budget the engine enforces and which has not started answering yet
(actors/engine/core/reasoning_gate.py: the simplest sound rule, as its masks change with its phase). A
constrained request's drafts stop at the first token its grammar refuses, and each verify row is masked by the
grammar's state after the drafts before it (actors/engine/scheduling/grammar.py); penalties count the drafts
before each row in a copy of the request's counts (actors/engine/core/batch.py). It then verifies `k`
drafted tokens in one step: `k + 1` decode rows, its last real token's and one per draft, each drawing the token
after its position as decoding one token a step would (greedy: the argmax; sampled: our draws are a pure function
of seed, position and logits, kernels/sampling.py). Verification keeps the drafts while each equals the token
drawn at the position before it, then the token drawn where they part (the "bonus"), so the output is token for
token what decoding one token a step gives, sampled output included (stronger than rejection sampling, which
keeps only the distribution). The KV of rejected positions is freed by the engine at once (it never reaches the
prefix cache), and each emitted token's logprob is its own row's.

Never slower, per request: the draft length grows by one after a fully accepted draft and halves after a fully
rejected one; after repeated misses the request stops drafting for a while (2, 4, ... up to 32 steps) and then
tries again. Batches with more decode rows than `max_batch` do not speculate (the step is compute-bound there,
so verify rows cost nearly what they save).
"""

from __future__ import annotations

from dataclasses import dataclass

from ringserve.actors.engine.core.request import Req
from ringserve.actors.engine.speculative.draft_model import DraftModel
from ringserve.actors.engine.speculative.ngram import NgramIndex, SharedNgramPool

MIN_N, MAX_N = 2, 4  # n-gram sizes matched in the request's own tokens, longest first
POOL_N = 3  # n of the shared pool's n-grams
POOL_CAPACITY = 200_000  # shared n-grams kept (a few tens of MB at most)
MAX_BACKOFF_STEPS = 32


@dataclass
class SpeculationStats:
    """Totals since start: draft tokens proposed and accepted, tokens verify steps emitted, verify rows run."""

    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    verify_rows: int = 0


@dataclass
class _RequestState:
    index: NgramIndex
    k: int
    misses: int = 0
    wait: int = 0  # decode steps to skip drafting


class Speculator:
    """Drafts for the decode rows of one step, and the greedy verification of their outputs."""

    def __init__(self, num_draft_tokens: int, max_batch: int = 8, draft_model: DraftModel | None = None) -> None:
        """`draft_model`: drafts from a smaller model (`--speculative-algorithm draft`); None: n-grams."""
        self.num_draft_tokens = num_draft_tokens
        self.max_batch = max_batch
        self.draft_model = draft_model
        self.pool = SharedNgramPool(POOL_N, num_draft_tokens, POOL_CAPACITY)
        self.stats = SpeculationStats()
        self._states: dict[str, _RequestState] = {}

    def eligible(self, req: Req) -> bool:
        """Whether `req` may speculate: it did not opt out, no min_new_tokens ban is in force (a ban ending
        inside a verify step would need each row's own), and it is not a reasoning request still before or in
        its thinking whose constraint or budget the engine enforces (`Req.gate`: a phase change or a forced
        marker inside a verify step would need each row's own mask; it drafts once it answers)."""
        p = req.params
        return p.speculative and req.output_len >= p.min_new_tokens and req.gate is None

    def propose(self, reqs: list[Req], context_length: int, room: int) -> dict[Req, list[int]]:
        """Drafts for the decode rows `reqs` (each with every token applied), spending at most `room` KV slots."""
        if len(reqs) > self.max_batch:
            return {}
        wanted: dict[Req, int] = {}
        for req in reqs:
            if not self.eligible(req) or req.device_len != req.seq_len:
                continue
            state = self._states.get(req.rid)
            if state is None:
                state = self._states[req.rid] = _RequestState(NgramIndex(MIN_N, MAX_N), self.num_draft_tokens)
            if state.wait:
                state.wait -= 1
                continue
            # the bonus token comes on top of the drafts: both must fit the budget and the context
            budget = min(state.k, req.params.max_new_tokens - req.output_len - 1,
                         context_length - req.seq_len - 1, room)
            if budget <= 0:
                continue
            wanted[req] = budget
            room -= budget
        if self.draft_model is not None:
            return self.draft_model.draft(wanted)
        drafts = {req: self._states[req.rid].index.draft(req.ids, k) or self.pool.draft(req.ids, k)
                  for req, k in wanted.items()}
        return {req: found for req, found in drafts.items() if found}

    def verify(self, req: Req, drafts: list[int], predicted: list[int]) -> list[int]:
        """The tokens a verify row emits: its drafts while each equals `predicted` (the target's argmax at each of
        the row's positions, `len(drafts) + 1` of them), then the target's token where they part."""
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == predicted[accepted]:
            accepted += 1
        stats = self.stats
        stats.drafted += len(drafts)
        stats.accepted += accepted
        stats.emitted += accepted + 1
        stats.verify_rows += 1
        state = self._states.get(req.rid)
        if state is not None:
            if accepted == len(drafts):
                state.k, state.misses = min(self.num_draft_tokens, state.k + 1), 0
            elif accepted == 0:
                state.k, state.misses = max(1, state.k // 2), state.misses + 1
                if state.misses >= 2:
                    state.wait = min(MAX_BACKOFF_STEPS, 2 ** (state.misses - 1))
            else:
                state.misses = 0
        return drafts[:accepted] + [predicted[accepted]]

    def forget(self, req: Req) -> None:
        """`req` is done (finished, aborted or retracted): its n-grams join the shared pool."""
        self._states.pop(req.rid, None)
        self.pool.learn(req.ids)
