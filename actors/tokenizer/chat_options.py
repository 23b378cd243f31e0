"""The tokenizer's chat and reasoning flags, declared once for `ringserve serve` and the tokenizer worker.

    --reasoning-parser {auto,none,qwen3,deepseek_r1,gpt_oss,...}   how the model marks its thinking
    --reasoning-budget N                                           thinking tokens at most (-1: no limit)
    --default-chat-template-kwargs JSON                            template variables for every chat request
    --chat-template FILE                                           a Jinja chat template instead of the model's
    --generation-config {auto,none}                                the model's generation_config.json defaults

They are the fields of `ChatFlags` (actors/common/flag_fields.py). `ChatOptions.from_args` checks them
(ValueError saying which flag and why); `chat_argv` gives them back for the tokenizer's command line (the
launcher resolves `auto` first and passes the file's absolute path).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ringserve.actors.common import flag_fields
from ringserve.actors.common.flag_fields import flag
from ringserve.actors.common.help_format import CHAT
from ringserve.actors.common.reasoning import AUTO, get_format, parser_names

GENERATION_CONFIG_MODES = ("auto", "none")
# What the renderer itself passes a chat template (transformers' names too): a request may not replace them
RESERVED_TEMPLATE_NAMES = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "tokenize", "return_dict", "return_tensors", "chat_template", "padding", "truncation", "max_length",
    "tokenizer_kwargs", "return_assistant_tokens_mask", "raise_exception", "strftime_now", "namespace", "dict",
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
    "additional_special_tokens"})


@dataclass
class ChatFlags:
    """The chat and reasoning flags as given, declared once for `ringserve serve` and the tokenizer."""

    reasoning_parser: str = field(default=AUTO, metadata=flag(
        "how a reasoning model marks its thinking, so that chat replies carry it apart from the answer "
        "(reasoning_content): qwen3 (<think>...</think>; its aliases qwen3-thinking, glm45, kimi_k2, deepseek_v3), "
        "deepseek_r1 (the same markers, the template opens the thinking), gpt_oss (harmony's analysis channel), "
        "none, or auto: the one the chat template writes (none when it writes no thinking)",
        group=CHAT, choices=parser_names(), metavar="NAME"))
    reasoning_budget: int = field(default=-1, metadata=flag(
        "the most tokens a reasoning model may think before its thinking is closed, unless the request sets "
        "thinking_token_budget; -1: no limit", group=CHAT, metavar="TOKENS"))
    default_chat_template_kwargs: str | None = field(default=None, metadata=flag(
        "a JSON object of extra chat template variables for every chat request, e.g. '{\"enable_thinking\": "
        "false}'; a request's chat_template_kwargs override them key by key", group=CHAT, metavar="JSON"))
    chat_template: str | None = field(default=None, metadata=flag(
        "a Jinja chat template file to render chat requests with instead of the model's own (also what "
        "--tool-call-parser auto and --reasoning-parser auto read)", group=CHAT, metavar="FILE"))
    generation_config: str = field(default="auto", metadata=flag(
        "auto: the model directory's generation_config.json sets the default temperature, top_p, top_k, min_p, "
        "repetition_penalty and max_new_tokens of requests that leave them out (the request always wins; "
        "/get_model_info shows them); none: ringserve's own defaults", group=CHAT, choices=GENERATION_CONFIG_MODES))


@dataclass
class ChatOptions:
    """What the tokenizer's chat flags say, checked."""

    reasoning_parser: str = AUTO  # `auto`: resolved from the chat template where the template is known
    reasoning_budget: int = -1  # -1: no limit unless the request sets thinking_token_budget
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    chat_template: str | None = None  # the template's text from --chat-template (None: the model's own)
    chat_template_file: str | None = None
    generation_config: str = "auto"

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ChatOptions":
        """The options of parsed flags; ValueError naming the flag that is wrong."""
        return cls.from_flags(flag_fields.from_args(ChatFlags, args))

    @classmethod
    def from_flags(cls, flags: ChatFlags) -> "ChatOptions":
        """The options the flags say, checked (the template read); ValueError naming the flag that is wrong."""
        if flags.reasoning_parser != AUTO:
            get_format(flags.reasoning_parser)  # ValueError for an unknown name
        if flags.reasoning_budget < -1:
            raise ValueError(f"--reasoning-budget must be -1 (no limit) or at least 0, got {flags.reasoning_budget}")
        if flags.generation_config not in GENERATION_CONFIG_MODES:
            raise ValueError(f"--generation-config must be one of {', '.join(GENERATION_CONFIG_MODES)}")
        template = None
        if flags.chat_template:
            try:
                template = Path(flags.chat_template).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"--chat-template {flags.chat_template!r} cannot be read: {exc}") from None
            _check_template(template, flags.chat_template)
        return cls(flags.reasoning_parser, flags.reasoning_budget,
                   parse_template_kwargs(flags.default_chat_template_kwargs), template,
                   os.path.abspath(flags.chat_template) if flags.chat_template else None, flags.generation_config)

    def flags(self) -> ChatFlags:
        """The flags that give these options (the template by its absolute path)."""
        kwargs = json.dumps(self.default_chat_template_kwargs) if self.default_chat_template_kwargs else None
        return ChatFlags(self.reasoning_parser, self.reasoning_budget, kwargs, self.chat_template_file,
                         self.generation_config)

    @property
    def budget(self) -> int | None:
        """The server's default thinking budget (None: no limit)."""
        return None if self.reasoning_budget < 0 else self.reasoning_budget


def _check_template(text: str, path: str) -> None:
    """ValueError unless `text` compiles as a chat template."""
    import jinja2

    from ringserve.actors.common.chat_template import compile_template

    if not text.strip():
        raise ValueError(f"--chat-template {path!r} is empty")
    try:
        compile_template(text)
    except jinja2.TemplateError as exc:
        raise ValueError(f"--chat-template {path!r} is not a valid Jinja template: {exc}") from None


def parse_template_kwargs(text: str | None) -> dict[str, Any]:
    """--default-chat-template-kwargs: a JSON object whose keys are not the renderer's own; ValueError else."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"--default-chat-template-kwargs is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"--default-chat-template-kwargs must be a JSON object, got {type(value).__name__}")
    clash = sorted(RESERVED_TEMPLATE_NAMES & set(value))
    if clash:
        raise ValueError(f"--default-chat-template-kwargs cannot set {clash[0]!r}: the chat template gets it from "
                         "the request")
    return value


def chat_argv(options: ChatOptions) -> list[str]:
    """The tokenizer's command line for `options` (the template by its absolute path)."""
    return flag_fields.to_argv(options.flags())
