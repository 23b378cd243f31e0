"""Splitting one request's released output text into its thinking and its answer, incrementally.

The detokenizer feeds `ReasoningSplitter` the text the `IncrementalDecoder` releases (after stop-string
hold-back and trimming) and publishes the two parts as `RequestOutput.reasoning_text` and `RequestOutput.text`.
The request's `ReasoningPlan` (bus/reasoning.py) says how the output opens:

- `open`: the output starts inside the thinking. Otherwise it is thinking only if it begins with `start`
  (whitespace before it allowed); any other beginning makes the whole output the answer, as written.
- Inside the thinking, text up to `end` is reasoning; after `end` everything is answer (a later `start` too).
- The markers appear in neither part. Whitespace right after `start` (or at the start of an open plan's output)
  and right before `end` is dropped from the reasoning, and whitespace right after `end` from the answer
  (Qwen3 writes `</think>\\n\\n`).
- Framing the plan names between the end marker and the answer (`answer_prefix`: gpt-oss's final-channel
  header) is dropped where the answer begins with it, held back while it may still be it.
- A request cut off while thinking (no `end` by its finish) gets everything held as reasoning and no answer.

While streaming, text is held back only while it may still change part: a beginning that may be `start`, a
suffix of the thinking that may begin `end`, and the thinking's trailing whitespace (dropped if `end` follows).
So the concatenated parts equal a one-shot split of the whole text for any split of it into feeds, and what
is held is bounded by the markers' length plus a run of whitespace.
"""

from __future__ import annotations

from ringserve.actors.detokenizer.held_text import held_suffix
from ringserve.bus.reasoning import ReasoningPlan

OPENING = "opening"  # a closed plan's output before it is known whether it begins with the start marker
THINKING = "thinking"
ANSWER = "answer"


class ReasoningSplitter:
    """One request's split state: `feed` the released text, get back (new reasoning text, new answer text)."""

    def __init__(self, plan: ReasoningPlan) -> None:
        self._start = plan.start
        self._end = plan.end
        self._state = THINKING if plan.open else OPENING
        self._held = ""  # text not yet sent: a possible start marker, or thinking that may precede `end`
        self._trim = plan.open  # drop the whitespace now at the head of the current part (thinking or answer)
        self._prefix = ""  # the answer's framing still to look for at its head (set when the thinking ends)
        self._answer_prefix = plan.answer_prefix

    @property
    def state(self) -> str:
        """Where the output is: "opening" (a closed plan before its beginning is known), "thinking" or "answer"."""
        return self._state

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """Add released text; return the (reasoning, answer) text now safe to send. `final`: the request has
        finished and this is its last text, so nothing is held back any more."""
        reasoning = answer = ""
        if self._state == OPENING:
            answer, text = self._opening(text, final)
        if self._state == THINKING:
            reasoning, text = self._thinking(text, final)
        if self._state == ANSWER:
            answer += self._answer(text, final)
        return reasoning, answer

    def _opening(self, text: str, final: bool) -> tuple[str, str]:
        """Decide whether the output begins with the start marker: (answer, text left for the next state)."""
        held = self._held + text
        head = held.lstrip()
        if head.startswith(self._start):
            self._held, self._state, self._trim = "", THINKING, True
            return "", head[len(self._start):]
        if self._start.startswith(head) and not final:
            self._held = held  # whitespace and maybe the start marker's beginning: not known yet
            return "", ""
        self._held, self._state = "", ANSWER  # no thinking: everything, as written, is the answer
        return held, ""

    def _thinking(self, text: str, final: bool) -> tuple[str, str]:
        """Release thinking up to the end marker: (reasoning, text after the end marker)."""
        held = self._held + text
        if self._trim:
            held = held.lstrip()
            self._trim = not held
        cut = held.find(self._end)
        if cut >= 0:
            self._held, self._state, self._trim, self._prefix = "", ANSWER, True, self._answer_prefix
            return held[:cut].rstrip(), held[cut + len(self._end):]
        if final:  # cut off while thinking: all of it is reasoning
            self._held = ""
            return held, ""
        keep = len(held) - held_suffix(held, [self._end])
        send = held[:keep].rstrip()  # trailing whitespace is dropped if the end marker follows it
        self._held = held[len(send):]
        return send, ""

    def _answer(self, text: str, final: bool) -> str:
        if self._trim:
            text = text.lstrip()
            self._trim = not text
        if not self._prefix:
            return text
        held = self._held + text  # the answer's head: is it the framing to drop?
        if held.startswith(self._prefix):
            self._held, self._prefix = "", ""
            return held[len(self._answer_prefix):]
        if self._prefix.startswith(held) and not final:
            self._held = held
            return ""
        self._held, self._prefix = "", ""
        return held
