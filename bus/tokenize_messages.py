"""The tokenize/detokenize conversation on `{ns}.tokenizer.tokenize` (request/reply, tokenizers' queue group).

The entry serves `POST /v1/tokenize` and `POST /v1/detokenize` without a tokenizer of its own: it sends a
`TokenizeQuery` and a tokenizer answers a `TokenizeReply` in the entry's inbox. A query sets exactly one of
`text`, `messages` (tokenized as generation would: the same chat template and PromptEncoder) or `token_ids`
(detokenize). A query the tokenizer rejects is answered with `error` set (an ApiError naming the field).
A query with `model_info` set (and nothing else) asks what the tokenizer serves with instead: the sampling
defaults in force (`--generation-config`) and the reasoning parser, for the entry's `/get_model_info`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ringserve.bus.errors import ApiError
from ringserve.bus.messages import ChatMessage


@dataclass
class TokenizeQuery:
    """Tokenize `text` or `messages`, or detokenize `token_ids`.

    `add_special_tokens`: None means the default of the form (true for text, false for messages, whose chat
    template already holds them); `add_generation_prompt` and `continue_final_message` apply to messages only.
    Detokenizing keeps special tokens in the text, as vLLM's `/detokenize` does.
    """

    text: str | None = None
    messages: list[ChatMessage] | None = None
    token_ids: list[int] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None  # messages only: function tools the template renders (as generation's)
    # messages only: extra chat template variables over --default-chat-template-kwargs (as GenerateRequest's)
    chat_template_kwargs: dict[str, Any] | None = None
    model_info: bool = False  # answer `default_sampling_params` and `reasoning_parser` instead


@dataclass
class TokenizeReply:
    """The token ids (tokenize) or the text (detokenize), the model's context length, or the error; for a
    `model_info` query, the sampling defaults in force and the reasoning parser."""

    tokens: list[int] = field(default_factory=list)
    text: str | None = None
    max_model_len: int = 0
    error: ApiError | None = None
    # model_info: what a request leaving them out gets from the model's generation_config.json (native names)
    default_sampling_params: dict[str, Any] = field(default_factory=dict)
    reasoning_parser: str = ""  # model_info: the server's --reasoning-parser, resolved ("none": off)
