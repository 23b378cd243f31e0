"""The tokenizer's side of reasoning models: each chat request's `ReasoningPlan` (bus/reasoning.py).

With a reasoning parser (`--reasoning-parser`, resolved from the chat template when `auto`), every chat request
whose rendered prompt leaves the model free to think gets a plan (actors/common/reasoning/plan.py): the markers
and their token ids, whether the prompt opened the thinking, and the budget, the request's
`thinking_token_budget` else `--reasoning-budget`. Text and token-id prompts get none. A request that sets
`thinking_token_budget` without a reasoning parser, or on a prompt that is not chat, is a 400 naming it. Markers
that are special tokens (gpt-oss's) must stay in the text for the detokenizer to split it, so such a plan keeps
special tokens unless the request set `skip_special_tokens` itself.
"""

from __future__ import annotations

import logging
from typing import Any

from ringserve.actors.common.reasoning import AUTO, get_format, make_plan, marker_ids, parser_for_template
from ringserve.bus.errors import ApiError
from ringserve.bus.params import SPECS, SamplingParams
from ringserve.bus.reasoning import ReasoningPlan
from ringserve.observability.logging import log_event

log = logging.getLogger("tokenizer")
BUDGET = "thinking_token_budget"


class ReasoningPlanner:
    """Makes the reasoning plans of one server's requests."""

    def __init__(self, tokenizer: Any, parser: str, budget: int | None) -> None:
        """`parser`: the reasoning parser's name (`auto`: the one `tokenizer`'s chat template asks for; `none`: no
        reasoning); `budget`: the server's default thinking budget in tokens (None: no limit)."""
        if parser == AUTO:
            parser = parser_for_template(getattr(tokenizer, "chat_template", None))
            log_event(log, logging.INFO, "reasoning parser chosen from the chat template", parser=parser)
        self.format = get_format(parser)
        self.name = parser
        self.budget = budget
        self.markers = marker_ids(self.format, tokenizer) if self.format is not None else None

    def plan(self, chat_text: str | None, sampling: SamplingParams, raw: dict[str, Any],
             openai_names: bool) -> ReasoningPlan | None:
        """The plan of a request whose rendered chat prompt is `chat_text` (None: not a chat request) and whose
        checked parameters are `sampling` (as sent: `raw`); sets `sampling.skip_special_tokens` to False where
        the markers are special tokens and the request left it out. ApiError for a budget it cannot honour."""
        requested = sampling.thinking_token_budget
        if requested is not None and (self.format is None or chat_text is None):
            why = "the server has no reasoning parser (--reasoning-parser)" if self.format is None \
                else "it needs a chat prompt (messages)"
            name = SPECS[BUDGET].label(openai_names)
            raise ApiError(f"{name} cannot be honoured: {why}", param=name)
        if self.format is None or chat_text is None:
            return None
        assert self.markers is not None
        plan = make_plan(self.format, self.markers, chat_text, self.budget if requested is None else requested)
        if plan is not None and self.markers.special and raw.get("skip_special_tokens") is None:
            sampling.skip_special_tokens = False
        return plan
