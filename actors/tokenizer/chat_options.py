"""The tokenizer's chat and reasoning flags, declared once for `ringserve serve` and the tokenizer worker.

    --reasoning-parser {auto,none,qwen3,deepseek_r1,gpt_oss,...}   how the model marks its thinking
    --reasoning-budget N                                           thinking tokens at most (-1: no limit)
    --default-chat-template-kwargs JSON                            template variables for every chat request
    --chat-template FILE                                           a Jinja chat template instead of the model's
    --generation-config {auto,none}                                the model's generation_config.json defaults

`ChatOptions.from_args` checks them (ValueError saying which flag and why); `chat_argv` gives them back for the
tokenizer's command line (the launcher resolves `auto` first and passes the file's absolute path).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
        if args.reasoning_parser != AUTO:
            get_format(args.reasoning_parser)  # ValueError for an unknown name
        if args.reasoning_budget < -1:
            raise ValueError(f"--reasoning-budget must be -1 (no limit) or at least 0, got {args.reasoning_budget}")
        if args.generation_config not in GENERATION_CONFIG_MODES:
            raise ValueError(f"--generation-config must be one of {', '.join(GENERATION_CONFIG_MODES)}")
        template = None
        if args.chat_template:
            try:
                template = Path(args.chat_template).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"--chat-template {args.chat_template!r} cannot be read: {exc}") from None
            _check_template(template, args.chat_template)
        return cls(args.reasoning_parser, args.reasoning_budget,
                   parse_template_kwargs(args.default_chat_template_kwargs), template,
                   os.path.abspath(args.chat_template) if args.chat_template else None, args.generation_config)

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


def add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    """The chat and reasoning flags, on the tokenizer's parser and on `ringserve serve`."""
    parser.add_argument("--reasoning-parser", default=AUTO, choices=parser_names(), metavar="NAME",
                        help="how a reasoning model marks its thinking, so that chat replies carry it apart from the "
                             "answer (reasoning_content): qwen3 (<think>...</think>; its aliases qwen3-thinking, "
                             "glm45, kimi_k2, deepseek_v3), deepseek_r1 (the same markers, the template opens the "
                             "thinking), gpt_oss (harmony's analysis channel), none, or auto: the one the chat "
                             "template writes (none when it writes no thinking)")
    parser.add_argument("--reasoning-budget", type=int, default=-1, metavar="TOKENS",
                        help="the most tokens a reasoning model may think before its thinking is closed, unless the "
                             "request sets thinking_token_budget; -1: no limit")
    parser.add_argument("--default-chat-template-kwargs", default=None, metavar="JSON",
                        help="a JSON object of extra chat template variables for every chat request, e.g. "
                             "'{\"enable_thinking\": false}'; a request's chat_template_kwargs override them key by "
                             "key")
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="a Jinja chat template file to render chat requests with instead of the model's own "
                             "(also what --tool-call-parser auto and --reasoning-parser auto read)")
    parser.add_argument("--generation-config", default="auto", choices=GENERATION_CONFIG_MODES,
                        help="auto: the model directory's generation_config.json sets the default temperature, "
                             "top_p, top_k, min_p, repetition_penalty and max_new_tokens of requests that leave "
                             "them out (the request always wins; /get_model_info shows them); none: ringserve's "
                             "own defaults")


def chat_argv(options: ChatOptions) -> list[str]:
    """The tokenizer's command line for `options` (the template by its absolute path)."""
    argv = ["--reasoning-parser", options.reasoning_parser, "--reasoning-budget", str(options.reasoning_budget),
            "--generation-config", options.generation_config]
    if options.default_chat_template_kwargs:
        argv += ["--default-chat-template-kwargs", json.dumps(options.default_chat_template_kwargs)]
    if options.chat_template_file:
        argv += ["--chat-template", options.chat_template_file]
    return argv
