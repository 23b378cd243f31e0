"""A chat request's `ReasoningPlan` (bus/reasoning.py), from its rendered prompt.

Where the prompt leaves the thinking, read from its tail after the last start marker: no start marker, or one
closed earlier in the conversation (an assistant turn of the history), and the output is thinking only if the
model opens it; a start marker with no end marker after it (DeepSeek-R1's `<think>\\n`), and the output opens
as thinking (`open`); a start marker closed at the very end of the prompt (Qwen3's `enable_thinking: false`
writes `<think>\\n\\n</think>\\n\\n`), and the template has turned the thinking off: no plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ringserve.actors.common.reasoning.formats import ReasoningFormat
from ringserve.bus.reasoning import ReasoningPlan

OPEN, CLOSED, FREE = "open", "closed", "free"


@dataclass(frozen=True)
class MarkerIds:
    """A format's markers as the model writes them (token ids, no special tokens added), and whether decoding
    them skipping special tokens loses them (gpt-oss's: the text must keep special tokens to be split)."""

    start: list[int]
    end: list[int]
    special: bool


def marker_ids(fmt: ReasoningFormat, tokenizer: Any) -> MarkerIds:
    """`fmt`'s markers tokenized by `tokenizer` (transformers' or a TextTokenizer)."""
    start = list(tokenizer.encode(fmt.start, add_special_tokens=False))
    end = list(tokenizer.encode(fmt.end, add_special_tokens=False))
    special = any(tokenizer.decode(ids, skip_special_tokens=True) != tokenizer.decode(ids, skip_special_tokens=False)
                  for ids in (start, end))
    return MarkerIds(start, end, special)


def prompt_state(prompt: str, fmt: ReasoningFormat) -> str:
    """OPEN: the prompt ends inside the thinking; CLOSED: the template closed it at the end of the prompt (the
    thinking is off); FREE: the model may open it."""
    cut = prompt.rfind(fmt.start)
    if cut < 0:
        return FREE
    tail = prompt[cut + len(fmt.start):]
    end = tail.rfind(fmt.end)
    if end < 0:
        return OPEN
    return CLOSED if not tail[end + len(fmt.end):].strip() else FREE


def make_plan(fmt: ReasoningFormat, ids: MarkerIds, prompt: str, budget: int | None) -> ReasoningPlan | None:
    """The plan of a chat request whose rendered prompt is `prompt`; None when the template turned thinking off.
    `budget`: the effective thinking budget in tokens (None: no limit)."""
    state = prompt_state(prompt, fmt)
    if state == CLOSED:
        return None
    return ReasoningPlan(parser=fmt.name, start=fmt.start, end=fmt.end, start_ids=list(ids.start),
                         end_ids=list(ids.end), open=state == OPEN, budget=budget, answer_prefix=fmt.answer_prefix)
