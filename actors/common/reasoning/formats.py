"""The reasoning formats, by name: the markers a model writes around its thinking.

| name (aliases) | start | end | models |
|---|---|---|---|
| `qwen3` (`qwen3-thinking`, `glm45`, `kimi_k2`, `deepseek_v3`, `deepseek-v3`) | `<think>` | `</think>` | Qwen3, QwQ, GLM-4.5, Kimi-K2-Thinking, DeepSeek-V3.1 |
| `deepseek_r1` (`deepseek-r1`) | `<think>` | `</think>` | DeepSeek-R1 and its distills, Qwen3 *-Thinking-2507 |
| `gpt_oss` (`gpt-oss`) | `<\\|channel\\|>analysis<\\|message\\|>` | `<\\|end\\|>` | gpt-oss (harmony) |

gpt-oss's answer then opens with its final channel's header, `<|start|>assistant<|channel|>final<|message|>`,
which the split drops (`answer_prefix`); a call on the commentary channel stays in the answer for the `openai`
tool-call parser.

`qwen3` and `deepseek_r1` share markers: whether the output starts inside the thinking is read from the rendered
prompt (DeepSeek-R1's template ends it with `<think>\\n`), not from the name. `none` turns reasoning off; `auto`
(the flag's default) is resolved from the chat template (detect.py).
"""

from __future__ import annotations

from dataclasses import dataclass

AUTO = "auto"
NONE = "none"


@dataclass(frozen=True)
class ReasoningFormat:
    """A reasoning parser: its canonical name and the text of its start and end markers."""

    name: str
    start: str
    end: str
    answer_prefix: str = ""  # framing between the end marker and the answer (ReasoningPlan.answer_prefix)


_THINK = ("<think>", "</think>")
_CANONICAL = {
    "qwen3": ReasoningFormat("qwen3", *_THINK),
    "deepseek_r1": ReasoningFormat("deepseek_r1", *_THINK),
    "gpt_oss": ReasoningFormat("gpt_oss", "<|channel|>analysis<|message|>", "<|end|>",
                               "<|start|>assistant<|channel|>final<|message|>"),
}
_ALIASES = {"qwen3-thinking": "qwen3", "glm45": "qwen3", "kimi_k2": "qwen3", "deepseek_v3": "qwen3",
            "deepseek-v3": "qwen3", "deepseek-r1": "deepseek_r1", "gpt-oss": "gpt_oss"}
FORMATS: dict[str, ReasoningFormat] = {**_CANONICAL, **{alias: _CANONICAL[name] for alias, name in _ALIASES.items()}}


def parser_names() -> list[str]:
    """Every value `--reasoning-parser` takes: auto, none and the registered names (aliases included)."""
    return [AUTO, NONE, *sorted(FORMATS)]


def get_format(name: str) -> ReasoningFormat | None:
    """The format registered as `name` (None for `none`); ValueError naming the known ones otherwise (`auto` must
    be resolved first)."""
    if name == NONE:
        return None
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; expected one of {', '.join(parser_names()[1:])} "
                         "(or auto)") from None
