"""Reasoning parsers: how a reasoning model marks its thinking, by the names vLLM and SGLang give the formats.

`formats.py` registers each format (its start and end markers) under its names and aliases; `detect.py` picks
one from a chat template (`--reasoning-parser auto`); `plan.py` makes a chat request's `ReasoningPlan`
(bus/reasoning.py) from its rendered prompt. The tokenizer makes the plan; the engine and the detokenizer read
only the plan, never these modules' names.
"""

from __future__ import annotations

from ringserve.actors.common.reasoning.detect import parser_for_template
from ringserve.actors.common.reasoning.formats import AUTO, FORMATS, NONE, ReasoningFormat, get_format, parser_names
from ringserve.actors.common.reasoning.plan import MarkerIds, make_plan, marker_ids

__all__ = ["AUTO", "FORMATS", "NONE", "MarkerIds", "ReasoningFormat", "get_format", "make_plan", "marker_ids",
           "parser_for_template", "parser_names"]
