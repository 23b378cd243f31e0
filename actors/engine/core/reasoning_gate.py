"""A reasoning request's thinking phase in the engine: output constraints from the end of the thinking, and its
token budget (bus/reasoning.py's `ReasoningPlan`).

A request whose plan matters to the engine (it has an output constraint or a thinking budget) owns a
`ReasoningGate` (`Req.gate`) until it answers. Its output goes through these phases:

- "before" (a plan whose prompt did not open the thinking): the first output token either opens the thinking
  (`start_ids[0]`; the rest of a several-token start marker is then forced, "opening") or is the first token
  of the answer. With a grammar, its mask is the grammar's with `start_ids[0]` allowed too.
- "thinking": no mask, and nothing goes to the grammar matcher. It ends when the output ends with `end_ids`
  (written by the model, or forced). Each token counts against the budget, the markers aside; once the
  budget is spent the rest of the end marker is forced ("closing"), one marker token a step, by a mask
  allowing only that token. A budget of 0 closes the thinking at once.
- "spacing" (constrained requests whose engine knows its whitespace tokens: `Spacing`): right after the end
  marker the answer may open with up to `MAX_LEADING_SPACE` whitespace-only tokens before its grammar applies,
  as Qwen3 writes `</think>\n\n` before its answer (a compact JSON grammar would refuse the newlines and push
  the model off its answer). Those tokens bypass the matcher; the detokenizer drops them from the answer.
- "answer": the grammar applies as for any constrained request (mask, matcher, jump-forward, drafts). The gate
  is dropped then (`GrammarManager.accept` sets `Req.gate` to None), so an answering request costs nothing
  more than one without a plan.

Requests with a plan but neither constraint nor budget get no gate: the engine has nothing to do for them (the
detokenizer splits their text with the plan on their first row).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from ringserve.bus.reasoning import ReasoningPlan
from ringserve.kernels.grammar.torch_bitmask import allocate_bitmask, set_allowed

Phase = Literal["before", "opening", "thinking", "closing", "spacing", "answer"]
Fed = Literal["refused", "taken", "answer"]  # refused: not the forced token; taken: the gate's, not the grammar's
MAX_LEADING_SPACE = 8  # whitespace tokens an answer may open with before its grammar applies


@dataclass(frozen=True)
class Spacing:
    """The vocabulary's whitespace-only tokens, as ids and as one packed bitmask row (kernels/grammar's layout)."""

    ids: frozenset[int]
    row: torch.Tensor


class ReasoningGate:
    """One request's phase, the thinking tokens it has spent, and the marker tokens still to force."""

    def __init__(self, plan: ReasoningPlan, spacing: Spacing | None = None) -> None:
        """`spacing`: the whitespace tokens a constrained answer may open with (None: the grammar applies at
        once after the end marker)."""
        self.plan = plan
        self._spacing = spacing
        self._spaced = 0  # whitespace tokens the answer opened with so far
        self.thought = 0  # tokens written while thinking, markers aside (the model's partial end marker counts)
        self._forced: list[int] = []  # the marker tokens still to write, next first ("opening", "closing")
        self._tail: list[int] = []  # the newest thinking tokens, as many as the end marker has
        self.phase: Phase = "before"
        if plan.open:
            self._think()
        elif not plan.start_ids:  # nothing can open the thinking: the request answers at once
            self.phase = "answer"

    @property
    def answering(self) -> bool:
        return self.phase == "answer"

    def masks(self, constrained: bool) -> bool:
        """Whether the next token's row needs a mask: a forced marker token, or the grammar (`constrained`)
        with the start marker in "before"."""
        return bool(self._forced) or (constrained and self.phase in ("before", "spacing"))

    def fill_bitmask(self, matcher: Any, mask: torch.Tensor, row: int) -> None:
        """Write the next token's allowed ids into `mask[row]` (only where `masks` says there is a mask)."""
        if self._forced:
            set_allowed(mask, row, self._forced[:1])
        elif self.phase == "spacing":  # the grammar's first tokens, or whitespace before them while it may
            matcher.fill_bitmask(mask, row)
            if self._spaced < MAX_LEADING_SPACE:
                mask[row] |= self._spacing.row  # type: ignore[union-attr]
        else:  # "before", constrained: the grammar's first tokens, or the start of the thinking
            matcher.fill_bitmask(mask, row)
            _allow(mask, row, self.plan.start_ids[0])

    def feed(self, token: int) -> Fed:
        """Advance past the request's next output `token`: "answer" when it belongs to the answer (the grammar
        takes it), "taken" when to the thinking, a marker or the answer's leading whitespace, "refused" when it is
        not the marker token this request was forced to write."""
        if self._forced:
            if token != self._forced[0]:
                return "refused"
            self._forced.pop(0)
            if not self._forced:
                if self.phase == "opening":
                    self._think()
                else:
                    self._answer()
            return "taken"
        if self.phase == "spacing":
            if token in self._spacing.ids and self._spaced < MAX_LEADING_SPACE:  # type: ignore[union-attr]
                self._spaced += 1
                return "taken"
            self.phase = "answer"
            return "answer"
        if self.phase == "before":
            start = self.plan.start_ids
            if token != start[0]:
                self.phase = "answer"
                return "answer"
            if len(start) > 1:
                self.phase, self._forced = "opening", start[1:]
            else:
                self._think()
            return "taken"
        if self.phase == "answer":
            return "answer"
        # thinking, the model's own token
        end = self.plan.end_ids
        self._tail.append(token)
        del self._tail[:-len(end) or None]
        if end and self._tail == end:
            self._answer()
            return "taken"
        self.thought += 1
        self._close_if_spent()
        return "taken"

    def _answer(self) -> None:
        """The thinking has ended: the answer follows, after its leading whitespace where that is allowed."""
        self.phase = "spacing" if self._spacing is not None else "answer"

    def _think(self) -> None:
        self.phase = "thinking"
        self._close_if_spent()

    def _close_if_spent(self) -> None:
        """Force the end marker once the budget is spent (its part the thinking already ends with, after)."""
        budget, end = self.plan.budget, self.plan.end_ids
        if budget is None or self.thought < budget:
            return
        written = next((n for n in range(min(len(end) - 1, len(self._tail)), 0, -1)
                        if self._tail[-n:] == end[:n]), 0)
        self.phase, self._forced = "closing", end[written:]


def reasoning_gate(plan: ReasoningPlan | None, constrained: bool,
                   spacing: Spacing | None = None) -> ReasoningGate | None:
    """The gate of a request with `plan` and an output constraint or not (`constrained`; `spacing`: the whitespace
    its answer may open with); None when the engine has nothing to do for it: no plan, neither a constraint nor a
    budget, or no way to open the thinking."""
    if plan is None or (not constrained and plan.budget is None):
        return None
    gate = ReasoningGate(plan, spacing if constrained else None)
    return None if gate.answering else gate


def whitespace_tokens(tokenizer: Any, vocab_size: int) -> Spacing:
    """The tokens of `tokenizer` whose text is only whitespace (decoded in one batch where the tokenizer has a
    fast backend), for masks `vocab_size` wide."""
    ids = [[token] for token in range(min(len(tokenizer), vocab_size))]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    texts = backend.decode_batch(ids, skip_special_tokens=False) if backend is not None \
        else [tokenizer.decode(token) for token in ids]
    spaces = frozenset(token for token, text in enumerate(texts) if text and text.isspace())
    row = allocate_bitmask(1, vocab_size)
    set_allowed(row, 0, sorted(spaces))
    return Spacing(spaces, row[0])


def plan_error(plan: ReasoningPlan | None, vocab_size: int) -> str | None:
    """Why the engine cannot follow `plan` (marker ids outside the vocabulary, a budget with no end marker to
    close the thinking with); None when it can."""
    if plan is None:
        return None
    bad = [t for t in plan.start_ids + plan.end_ids if not 0 <= t < vocab_size]
    if bad:
        return f"reasoning markers {plan.start!r}/{plan.end!r} have token ids outside the vocabulary: {bad}"
    if plan.budget is not None and not plan.end_ids:
        return f"a thinking budget needs the end marker's token ids ({plan.end!r} has none)"
    return None


def _allow(mask: torch.Tensor, row: int, token: int) -> None:
    """Also allow `token` in packed `mask[row]` (int32 words: a word with bit 31 set is negative)."""
    word, bit = divmod(token, 32)
    value = (int(mask[row, word]) & 0xFFFFFFFF) | (1 << bit)
    mask[row, word] = value - (1 << 32) if value >= 1 << 31 else value
