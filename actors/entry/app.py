"""The Starlette app: OpenAI-compatible `/v1/*`, native `/generate`, `/health`, `/get_server_info`."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any, AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from actors.entry import openai_protocol as oai
from actors.entry.errors import ApiError
from actors.entry.request_flow import ClientDisconnected, DisconnectWatch, EntryService
from bus.messages import GenerateRequest, RequestOutput
from bus.subjects import InvalidRidError, new_rid, validate_rid

DEFAULT_GENERATE_MAX_NEW_TOKENS = 128
CLIENT_CLOSED_REQUEST = 499


def sse(data: Any) -> str:
    """One server-sent event line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


async def read_json(request: Request) -> dict[str, Any]:
    """The request body as a JSON object, or ApiError 400 saying why not."""
    body = await request.body()
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ApiError("the request body must be a JSON object")
    return data


def handles_errors(endpoint: Callable[[Request], Any]) -> Callable[[Request], Any]:
    """Turn ApiError into its OpenAI error response and a vanished client into status 499."""
    async def wrapped(request: Request) -> Response:
        try:
            return await endpoint(request)
        except ApiError as exc:
            return exc.response()
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)

    return wrapped


async def _collect(service: EntryService, request: Request, gen_req: GenerateRequest) -> tuple[str, list[int], RequestOutput]:
    stream, first = await service.start(request, gen_req)
    watch = DisconnectWatch(request)
    text, ids = [], []
    try:
        async for out in service.outputs(stream, first, watch):
            text.append(out.text)
            ids.extend(out.token_ids)
            last = out
    finally:
        watch.close()
    if last.error is not None:
        raise ApiError.from_info(last.error)
    return "".join(text), ids, last


def build_app(service: EntryService) -> Starlette:
    """The HTTP application over `service`."""

    async def openai_endpoint(request: Request, parse: Callable[..., tuple[GenerateRequest, oai.ApiOptions]]) -> Response:
        gen_req, options = parse(await read_json(request), new_rid(), service.served_model)
        if not options.stream:
            text, _, last = await _collect(service, request, gen_req)
            return JSONResponse(oai.full_response(gen_req.rid, options, text, last.finish, last.prompt_tokens,
                                                  last.completion_tokens))
        stream, first = await service.start(request, gen_req)

        async def events() -> AsyncIterator[str]:
            started = False
            async for out in service.outputs(stream, first):
                if out.error is not None:
                    yield sse(ApiError.from_info(out.error).body())
                    break
                if not started or out.text or out.finish is not None:
                    yield sse(oai.stream_chunk(gen_req.rid, options, out.text, out.finish, first=not started))
                    started = True
                if out.finish is not None and options.include_usage:
                    yield sse(oai.usage_chunk(gen_req.rid, options, out.prompt_tokens, out.completion_tokens))
            yield sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream")

    @handles_errors
    async def chat_completions(request: Request) -> Response:
        return await openai_endpoint(request, oai.parse_chat)

    @handles_errors
    async def completions(request: Request) -> Response:
        return await openai_endpoint(request, oai.parse_completion)

    @handles_errors
    async def generate(request: Request) -> Response:
        body = await read_json(request)
        try:
            rid = validate_rid(body["rid"]) if body.get("rid") is not None else new_rid()
        except InvalidRidError as exc:
            raise ApiError(str(exc), param="rid") from exc
        sampling = body.get("sampling_params") or {}
        if not isinstance(sampling, dict):
            raise ApiError("sampling_params must be an object", param="sampling_params")
        sampling.setdefault("max_new_tokens", DEFAULT_GENERATE_MAX_NEW_TOKENS)
        gen_req = GenerateRequest(rid=rid, text=body.get("text"), input_ids=body.get("input_ids"), sampling=sampling)
        if gen_req.text is not None and not isinstance(gen_req.text, str):
            raise ApiError("text must be a string", param="text")
        if gen_req.input_ids is not None and not (isinstance(gen_req.input_ids, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in gen_req.input_ids)):
            raise ApiError("input_ids must be a list of integers", param="input_ids")

        def meta(out: RequestOutput) -> dict[str, Any]:
            return {"id": rid, "finish_reason": asdict(out.finish) if out.finish else None,
                    "prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens}

        if not body.get("stream"):
            text, ids, last = await _collect(service, request, gen_req)
            return JSONResponse({"text": text, "output_ids": ids, "meta_info": meta(last)})
        stream, first = await service.start(request, gen_req)

        async def events() -> AsyncIterator[str]:
            async for out in service.outputs(stream, first):
                if out.error is not None:
                    yield sse(ApiError.from_info(out.error).body())
                    break
                yield sse({"text": out.text, "output_ids": out.token_ids, "meta_info": meta(out)})
            yield sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream")

    @handles_errors
    async def models(request: Request) -> Response:
        info = await service.scheduler_info()
        card = {"id": service.served_model, "object": "model", "created": 0, "owned_by": "ringserve",
                "max_model_len": info.context_length}
        return JSONResponse({"object": "list", "data": [card]})

    @handles_errors
    async def health(request: Request) -> Response:
        await service.scheduler_info()
        return JSONResponse({"status": "ok"})

    @handles_errors
    async def server_info(request: Request) -> Response:
        info = await service.scheduler_info()
        return JSONResponse({**asdict(info), "served_model_name": service.served_model,
                             "entry_live_requests": len(service.live)})

    return Starlette(routes=[
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/generate", generate, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/get_server_info", server_info, methods=["GET"]),
    ])
