"""The OpenAI-compatible routes: `/v1/chat/completions`, `/v1/completions`, `/v1/models`, `/v1/models/{id}`."""

from __future__ import annotations

import contextlib
from typing import Any, AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ringserve.actors.entry.openai import protocol as oai
from ringserve.actors.entry.openai import bodies as bodies
from ringserve.actors.entry.choices import ChoiceGroup
from ringserve.actors.entry.http_common import handles_errors, read_json, sse
from ringserve.actors.entry.openai.stream import StreamChunks
from ringserve.actors.entry.request_flow import EntryService
from ringserve.actors.entry.native.tokenize import ask_tokenizer
from ringserve.actors.entry.tool_parsers import DEFAULT_PARSER
from ringserve.bus.errors import ApiError
from ringserve.bus.messages import GenerateRequest
from ringserve.bus.subjects import new_rid
from ringserve.bus.tokenize_messages import TokenizeQuery

Parser = Callable[[dict[str, Any], str, str], tuple[list[GenerateRequest], oai.ApiOptions]]
# how the ring names a bad constraint
CONSTRAINT_PARAMS = {"response_format", "json_schema", "regex", "ebnf", "structural_tag"}


async def stream_events(group: ChoiceGroup, options: oai.ApiOptions) -> AsyncIterator[str]:
    """The SSE stream of a response: every choice's chunks merged (`StreamChunks`), usage (if asked) once all
    finished, [DONE]. An error in any choice is sent as an error event and ends the stream (aborting the other
    choices)."""
    chunks = StreamChunks(group.rid, options, [choice.index for choice in group.choices])
    failed = False
    async with contextlib.aclosing(group.merged()) as outputs:
        async for index, out in outputs:
            if out.error is not None:
                yield sse(out.error.body())
                failed = True
                break
            for chunk in chunks.feed(index, out):
                yield sse(chunk)
    if not failed and options.include_usage:
        yield sse(chunks.usage_chunk())
    yield sse("[DONE]")


def openai_routes(service: EntryService, tool_parser: str = DEFAULT_PARSER) -> list[Route]:
    """The OpenAI routes over `service`; `tool_parser` names the parser of tool calls (`tool_parsers.PARSERS`)."""

    async def openai_endpoint(request: Request, parse: Parser) -> Response:
        prompts, options = parse(await read_json(request), new_rid(), service.served_model)
        await service.require_adapter(options.lora_name, options.model)
        if service.images is not None:
            await service.images.resolve_all(prompts)
        for i in options.echo_ids:  # echo of a token-id prompt: its text, decoded by a tokenizer
            ids = options.echo[i]
            assert isinstance(ids, list)
            try:
                options.echo[i] = (await ask_tokenizer(service, TokenizeQuery(token_ids=ids))).text or ""
            except ApiError as exc:
                if exc.code == 400:  # the client's ids: its prompt is what is wrong
                    exc.param = "prompt"
                raise
        try:
            group = await ChoiceGroup.start(service, request, prompts, options.n)
        except ApiError as exc:  # the tokenizer names the native constraint; the client sent another field
            if options.constraint_param and exc.param in CONSTRAINT_PARAMS:
                exc.param = options.constraint_param
            raise
        if not options.stream:
            return JSONResponse(bodies.full_response(group.rid, options, await group.collect(request)))
        return StreamingResponse(stream_events(group, options), media_type="text/event-stream")

    def parse_chat(body: dict[str, Any], rid: str, served_model: str) -> tuple[list[GenerateRequest],
                                                                              oai.ApiOptions]:
        gen_req, options = oai.parse_chat(body, rid, served_model, tool_parser)
        return [gen_req], options

    @handles_errors
    async def chat_completions(request: Request) -> Response:
        return await openai_endpoint(request, parse_chat)

    @handles_errors
    async def completions(request: Request) -> Response:
        return await openai_endpoint(request, oai.parse_completion)

    async def card() -> dict[str, Any]:
        info = await service.scheduler_info()
        return {"id": service.served_model, "object": "model", "created": 0, "owned_by": "ringserve",
                "max_model_len": info.context_length, "root": info.model or service.served_model,
                "weight_version": info.weight_version}

    async def adapter_cards() -> list[dict[str, Any]]:
        """The LoRA adapters served, each a model whose `parent` is the served model (vLLM's cards)."""
        adapters = (await service.scheduler_info()).lora_adapters
        return [{"id": name, "object": "model", "created": 0, "owned_by": "ringserve", "root": name,
                 "parent": service.served_model} for name in adapters]

    @handles_errors
    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [await card(), *await adapter_cards()]})

    @handles_errors
    async def model(request: Request) -> Response:
        model_id = request.path_params["model"]
        if model_id != service.served_model:
            name = model_id.removeprefix(service.served_model + ":")
            found = [c for c in await adapter_cards() if c["id"] == name]
            if not found:
                raise oai.model_not_found(model_id, service.served_model)
            return JSONResponse(found[0])
        return JSONResponse(await card())

    # The id may hold slashes (`org/name`; clients send them as %2F, which arrives decoded): matched as a path,
    # but named `{model}` as in the OpenAPI document.
    model_route = Route("/v1/models/{model:path}", model, methods=["GET"])
    model_route.path = "/v1/models/{model}"
    return [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        model_route,
    ]
