"""The chat template's switches a chat-shaped body may set: vLLM's `chat_template_kwargs` (extra variables for the
template, e.g. Qwen3's `enable_thinking`) and OpenAI's `reasoning_effort` (gpt-oss's template reads it as the
variable `reasoning_effort`), declared once here for every route that takes them (chat completions, Responses,
Messages) and for the OpenAPI document.

Only shapes are checked: the keys of `chat_template_kwargs` are passed through to the template as the peers pass
them (the tokenizer renders it; `GenerateRequest.chat_template_kwargs`). A value a route derives from its own
fields (`reasoning_effort`, Anthropic's `thinking`) fills a key only where the kwargs leave it unset: the
explicit kwargs win.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ringserve.bus.errors import ApiError
from ringserve.bus.param_spec import Spec

CHAT_TEMPLATE_KWARGS = Spec("vLLM's: extra variables for the chat template (e.g. {\"enable_thinking\": false} for "
                            "Qwen3), over the server's --default-chat-template-kwargs; unknown keys reach the "
                            "template too", kind="object", name="chat_template_kwargs")
EFFORTS = ("low", "medium", "high")
REASONING_EFFORT = Spec("how hard a reasoning model thinks: passed to the chat template as reasoning_effort "
                        "(gpt-oss's reads it), unless chat_template_kwargs sets it", kind="string",
                        choices=EFFORTS, name="reasoning_effort")
EFFORT_VARIABLE = "reasoning_effort"  # the template variable the effort reaches (vLLM's)
THINKING_VARIABLE = "enable_thinking"  # Qwen3's switch (and the Anthropic thinking config's)


def template_kwargs(value: Any, name: str = CHAT_TEMPLATE_KWARGS.name) -> dict[str, Any] | None:
    """A body's `chat_template_kwargs` (None: absent), or a 400 naming `name` when it is not an object."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ApiError(f"{name} must be an object (the chat template's variables by name)", param=name)
    return dict(value)


def with_defaults(kwargs: dict[str, Any] | None, **derived: Any) -> dict[str, Any] | None:
    """`kwargs` with each derived variable (not None) added where the kwargs do not set it; None if empty."""
    merged = dict(kwargs or {})
    for key, value in derived.items():
        if value is not None:
            merged.setdefault(key, value)
    return merged or None


def read_effort(value: Any, name: str = REASONING_EFFORT.name) -> str | None:
    """A reasoning effort (low, medium or high; None: absent), or a 400 naming `name`."""
    if value is None:
        return None
    try:
        return dataclasses.replace(REASONING_EFFORT, name=name).check(value)
    except ApiError as exc:
        exc.param = name.split(".")[0]  # a nested field is named by the body field that holds it
        raise
