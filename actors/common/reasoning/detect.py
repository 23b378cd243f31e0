"""`--reasoning-parser auto`: the reasoning format a chat template asks for.

Harmony's `<|channel|>` (gpt-oss) picks `gpt_oss`; a template that writes `<think>` or `</think>` picks `qwen3`,
or `deepseek_r1` when its generation prompt opens the thinking (DeepSeek-R1's, QwQ's and Qwen3's *-Thinking-2507
end it with `<think>\\n`); any other template: `none`.
"""

from __future__ import annotations

from typing import Any

from ringserve.actors.common.reasoning.formats import FORMATS, NONE
from ringserve.actors.common.reasoning.plan import OPEN, prompt_state

_PROBE = [{"role": "user", "content": "Hi"}]
_NO_TOKENS: dict[str, Any] = {"bos_token": "", "eos_token": ""}  # the probe renders without a tokenizer


def parser_for_template(template: str | dict[str, str] | None) -> str:
    """The reasoning parser for a chat template's text (a dict of named templates: all of them), or `none`."""
    texts = list(template.values()) if isinstance(template, dict) else [template or ""]
    if any("<|channel|>" in text for text in texts):
        return "gpt_oss"
    think = FORMATS["deepseek_r1"]
    thinking = [text for text in texts if think.start in text or think.end in text]
    if not thinking:
        return NONE
    return "deepseek_r1" if any(_opens_thinking(text) for text in thinking) else "qwen3"


def _opens_thinking(template: str) -> bool:
    """Whether the template's generation prompt, for one user turn, ends inside an open `<think>`."""
    from ringserve.actors.common.chat_template import render_chat

    try:
        prompt = render_chat(template, _PROBE, add_generation_prompt=True, variables=_NO_TOKENS)
    except Exception:  # noqa: BLE001 - a template may refuse the probe; then it does not open the thinking
        return False
    return prompt_state(prompt, FORMATS["deepseek_r1"]) == OPEN

