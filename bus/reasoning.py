"""How a request's output opens with the model's thinking: the reasoning plan, on the wire.

The tokenizer makes a `ReasoningPlan` for a chat request when the server has a reasoning parser
(`--reasoning-parser`, actors/common/reasoning/) and the rendered prompt leaves the model free to think (Qwen3's
`enable_thinking: false` closes the thinking inside the prompt: no plan then). The plan travels on
`TokenizedRequest.reasoning` to the scheduler, whose engine applies an output constraint only after the thinking
ends and closes the thinking when its budget is spent, and on the request's first `TokenRow` (inside
`DecodeParams.reasoning`) to the detokenizer, which splits the text into `RequestOutput.reasoning_text` (the
thinking, markers removed) and `RequestOutput.text` (the answer). Every route reads the split from there; no
one parses the thinking out of the text a second time.

Torch-free and import-light: the engine and every actor import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ReasoningPlan:
    """One request's thinking: the markers that open and close it, as text and as the token ids the model
    writes them with, whether the prompt already opened it, and its token budget.

    `answer_prefix`: framing the model writes between the end marker and its answer, not part of the answer
    (harmony's `<|start|>assistant<|channel|>final<|message|>`); dropped where the answer begins with it.
    `open`: the prompt ends inside the thinking (DeepSeek-R1's template writes the start marker itself), so the
    output starts as thinking. Otherwise the output is thinking only if it begins with `start` (leading
    whitespace aside); a model that answers at once has no thinking. `budget`: the most tokens the thinking may
    take (the markers not counted); once spent, the engine makes the model write `end_ids` next. None: no limit.
    """

    parser: str  # the reasoning parser's name (actors/common/reasoning/parsers.py), for logs and errors
    start: str  # e.g. "<think>"
    end: str  # e.g. "</think>"
    start_ids: list[int] = field(default_factory=list)
    end_ids: list[int] = field(default_factory=list)
    open: bool = False
    budget: int | None = None
    answer_prefix: str = ""
