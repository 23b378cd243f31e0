"""A model's Jinja chat template rendered as transformers renders it, without importing transformers.

The same sandboxed environment (trim_blocks, lstrip_blocks, loop controls, `{% generation %}` blocks), the
same globals (`raise_exception`, `strftime_now`, `dict`, `namespace`), the same `tojson`, the same message
normalisation (keys set to None dropped, reasoning fields aliased) and the same `continue_final_message` cut.
`TextTokenizer.export` checks a model's template against transformers' own rendering before it is used.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class TemplateRejected(ValueError):
    """The conversation cannot be rendered by this template (the template raised, or cut the final message)."""


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}`: marks assistant text for training masks; renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


class _Namespace(jinja2.utils.Namespace):
    """jinja's namespace, refusing underscore-prefixed attributes (no reach into CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's own signature trick: `namespace(self=...)` works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set {name!r} on a namespace")


class _Dict:
    """`dict(...)` and `dict.fromkeys(...)` for templates, without the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters, which no prompt wants
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    """The template compiled in the sandbox (cached: a model has one or two)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env.from_string(source)


def select_template(templates: str | dict[str, str] | None, tools: list[Any] | None) -> str:
    """The template to render: the model's one, or of its named ones `tool_use` (with tools) else `default`."""
    if isinstance(templates, dict):
        if tools is not None and "tool_use" in templates:
            return templates["tool_use"]
        if "default" in templates:
            return templates["default"]
        raise TemplateRejected(f"the model has several chat templates ({sorted(templates)}) and none is the default")
    if templates is None:
        raise TemplateRejected("the model has no chat template")
    return templates


def _normalised(message: dict[str, Any]) -> dict[str, Any]:
    message = {key: value for key, value in message.items() if value is not None}
    reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def render_chat(template: str, messages: list[dict[str, Any]], *, tools: list[Any] | None = None,
                add_generation_prompt: bool = False, continue_final_message: bool = False,
                variables: dict[str, Any] | None = None) -> str:
    """The prompt text for `messages` (plain JSON data); `variables` are the template's extra names (the special
    tokens). Raises TemplateRejected when the conversation cannot be rendered, jinja2 errors when the template
    raises."""
    chat = [_normalised(json.loads(json.dumps(m))) for m in messages]  # a deep copy: the tag below edits it
    final_text = ""
    if continue_final_message:
        if not chat or chat[-1].get("content") is None:
            raise TemplateRejected('continue_final_message needs a final message with "content"')
        if "content" not in template:
            raise TemplateRejected("continue_final_message: this chat template does not read the message content")
        final = chat[-1]["content"]
        if isinstance(final, (list, tuple)):
            block = next((b for b in reversed(final) if "text" in b), None)
            if block is None:
                raise TemplateRejected("continue_final_message: the final message has no text to continue")
            final_text, block["text"] = block["text"], block["text"] + _CONTINUE_TAG
        else:
            final_text, chat[-1]["content"] = final, final + _CONTINUE_TAG
    rendered = compile_template(template).render(messages=chat, tools=tools, documents=None,
                                                 add_generation_prompt=add_generation_prompt, **(variables or {}))
    if not continue_final_message:
        return rendered
    if final_text.strip() not in rendered or _CONTINUE_TAG.strip() not in rendered:
        raise TemplateRejected("continue_final_message: the chat template cut the final message")
    cut = rendered.rindex(_CONTINUE_TAG.strip())
    if rendered[cut:cut + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:cut]
    return rendered[:cut].rstrip()  # the template trimmed the message's trailing space
