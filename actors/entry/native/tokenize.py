"""vLLM's and SGLang's `POST /v1/tokenize` and `POST /v1/detokenize`, answered by a tokenizer over the bus.

The entry loads no tokenizer: it checks the body's shapes, sends a `TokenizeQuery` on `{ns}.tokenizer.tokenize`
(the tokenizers' queue group) and renders the `TokenizeReply`. Messages are flattened exactly as
`/v1/chat/completions` flattens them and tokenized by the same PromptEncoder, so `count` equals the
`usage.prompt_tokens` a chat completion with those messages reports. A tokenizer that does not answer within
`TOKENIZE_TIMEOUT` seconds gives 503.

    /v1/tokenize    {"prompt": str} or {"messages": [...], "add_generation_prompt": bool,
                    "continue_final_message": bool}, optional "add_special_tokens": bool, "model"
                    -> {"tokens": [ids], "count": n, "max_model_len": ctx}
    /v1/detokenize  {"tokens": [ids]}, optional "model" -> {"prompt": text}
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ringserve.actors.entry.http_common import handles_errors, read_json
from ringserve.actors.entry.openai.protocol import model_not_found, parse_chat
from ringserve.actors.entry.request_flow import EntryService
from ringserve.actors.entry.template_switches import CHAT_TEMPLATE_KWARGS, template_kwargs
from ringserve.bus.codec import encode
from ringserve.bus.errors import ApiError, server_error
from ringserve.bus.messages import GenerateRequest
from ringserve.bus.tokenize_messages import TokenizeQuery, TokenizeReply

TOKENIZE_TIMEOUT = 5.0
TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_generation_prompt", "continue_final_message",
                   "add_special_tokens", CHAT_TEMPLATE_KWARGS.name}
DETOKENIZE_FIELDS = {"model", "tokens"}


def _check_fields(body: dict[str, Any], allowed: set[str], served_model: str) -> None:
    for name in body:
        if name not in allowed:
            raise ApiError(f"Unrecognized request argument supplied: {name}"[:1000], param=str(name)[:100])
    model = body.get("model")
    if model is not None and model != served_model:
        raise model_not_found(model, served_model)


def _optional_bool(body: dict[str, Any], name: str, default: bool | None) -> bool | None:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(f"{name} must be a boolean, got {value!r}"[:1000], param=name)
    return value


def tokenize_query(body: dict[str, Any], served_model: str) -> TokenizeQuery:
    """A /v1/tokenize body as a TokenizeQuery (shapes only; the tokenizer checks the rest)."""
    _check_fields(body, TOKENIZE_FIELDS, served_model)
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise ApiError('give exactly one of "prompt" (a string) or "messages"', param="prompt")
    add_special_tokens = _optional_bool(body, "add_special_tokens", None)
    if prompt is not None:
        if not isinstance(prompt, str):
            raise ApiError("prompt must be a string", param="prompt")
        for name in ("add_generation_prompt", "continue_final_message", CHAT_TEMPLATE_KWARGS.name):
            if body.get(name) is not None:
                raise ApiError(f"{name} applies to messages only", param=name)
        return TokenizeQuery(text=prompt, add_special_tokens=add_special_tokens)
    turns = parse_chat({"messages": messages}, "tokenize", served_model)[0].messages
    continue_final = _optional_bool(body, "continue_final_message", False)
    add_generation_prompt = _optional_bool(body, "add_generation_prompt", not continue_final)
    return TokenizeQuery(messages=turns, add_special_tokens=add_special_tokens,
                         add_generation_prompt=bool(add_generation_prompt),
                         continue_final_message=bool(continue_final),
                         chat_template_kwargs=template_kwargs(body.get(CHAT_TEMPLATE_KWARGS.name)))


def detokenize_query(body: dict[str, Any], served_model: str) -> TokenizeQuery:
    """A /v1/detokenize body as a TokenizeQuery (the tokenizer checks that the ids are in the vocabulary)."""
    _check_fields(body, DETOKENIZE_FIELDS, served_model)
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise ApiError("tokens must be a list of token ids", param="tokens")
    for i, t in enumerate(tokens):
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise ApiError(f"tokens[{i}] must be a non-negative integer token id, got {t!r}"[:1000], param="tokens")
    return TokenizeQuery(token_ids=tokens)


async def ask_tokenizer(service: EntryService, query: TokenizeQuery) -> TokenizeReply:
    """The tokenizer's answer to `query`; its ApiError if it rejected it, 413 if too big, 503 if none answers."""
    bus, subjects = service.client.bus, service.client.subjects
    if query.messages is not None and service.images is not None:  # images go by handle (image_input.py)
        await service.images.resolve(GenerateRequest(rid="tokenize", messages=query.messages))
    if len(encode(query)) + 1024 > bus.max_payload:
        raise ApiError(f"the request exceeds the bus payload limit of {bus.max_payload} bytes", 413,
                       param="tokens" if query.token_ids is not None else
                       ("messages" if query.messages is not None else "prompt"))
    try:
        reply = await bus.request(subjects.tokenize, query, TokenizeReply, timeout=TOKENIZE_TIMEOUT)
    except asyncio.TimeoutError as exc:
        raise ApiError(f"no tokenizer answered: {exc}", 503, type="server_error", retry_after=1) from exc
    except Exception as exc:  # e.g. the connection is closed
        raise server_error(f"asking a tokenizer failed: {exc!r}"[:1000], 503) from exc
    if reply.error is not None:
        raise reply.error
    return reply


def tokenize_routes(service: EntryService) -> list[Route]:
    """`POST /v1/tokenize` and `POST /v1/detokenize` over `service`."""

    @handles_errors
    async def tokenize(request: Request) -> Response:
        reply = await ask_tokenizer(service, tokenize_query(await read_json(request), service.served_model))
        return JSONResponse({"tokens": reply.tokens, "count": len(reply.tokens), "max_model_len": reply.max_model_len})

    @handles_errors
    async def detokenize(request: Request) -> Response:
        reply = await ask_tokenizer(service, detokenize_query(await read_json(request), service.served_model))
        return JSONResponse({"prompt": reply.text or ""})

    return [
        Route("/v1/tokenize", tokenize, methods=["POST"]),
        Route("/v1/detokenize", detokenize, methods=["POST"]),
    ]
