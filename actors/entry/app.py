"""The Starlette app: OpenAI-compatible `/v1/*`, native `/generate`, `/health`, `/metrics`, `/get_server_info`,
`/openapi.json`, and the operator routes (`/flush_cache`, `/abort_request`, `/pause_generation`, ...), behind
the guard (API key, body limit) and, when origins are configured, CORS."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, AsyncIterator

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from actors.entry.control_routes import control_routes
from actors.entry.errors import error_response
from bus.errors import ApiError
from actors.entry.guard import EntryGuard
from actors.entry.http_common import handles_errors, read_json, sse
from actors.entry.metrics_scrape import metrics_route
from actors.entry.openapi_doc import openapi_document
from actors.entry.openai_logprobs import finite
from actors.entry.openai_protocol import STREAM
from actors.entry.openai_routes import openai_routes
from actors.entry.request_flow import DisconnectWatch, EntryService
from actors.entry.settings import EntrySettings
from bus.messages import GenerateRequest, RequestOutput, TokenLogprob
from bus.subjects import InvalidRidError, new_rid, validate_rid

DEFAULT_GENERATE_MAX_NEW_TOKENS = 128
# SGLang takes these next to sampling_params; here they are sampling parameters
_TOP_LEVEL_SAMPLING = ("return_logprob", "top_logprobs_num")


async def _collect(service: EntryService, request: Request, gen_req: GenerateRequest) -> list[RequestOutput]:
    """Every output of a non-streamed request; ApiError if it ended in an error."""
    stream, first = await service.start(request, gen_req)
    watch = DisconnectWatch(request)
    try:
        outputs = [out async for out in service.outputs(stream, first, watch)]
    finally:
        watch.close()
    if outputs[-1].error is not None:
        raise outputs[-1].error
    return outputs


def _logprob_meta(entries: list[TokenLogprob]) -> dict[str, Any]:
    """SGLang's logprob fields of meta_info: `[logprob, token_id, text]` per token, and per alternative."""
    return {"output_token_logprobs": [[finite(e.logprob), e.token_id, e.token] for e in entries],
            "output_top_logprobs": [[[finite(t.logprob), t.token_id, t.token] for t in e.top] for e in entries]}


def _generate_request(body: dict[str, Any]) -> GenerateRequest:
    """A /generate body as a GenerateRequest (shapes only; the tokenizer validates sampling values)."""
    try:
        rid = validate_rid(body["rid"]) if body.get("rid") is not None else new_rid()
    except InvalidRidError as exc:
        raise ApiError(str(exc), param="rid") from exc
    sampling = body.get("sampling_params") or {}
    if not isinstance(sampling, dict):
        raise ApiError("sampling_params must be an object", param="sampling_params")
    sampling.setdefault("max_new_tokens", DEFAULT_GENERATE_MAX_NEW_TOKENS)
    for name in _TOP_LEVEL_SAMPLING:
        if body.get(name) is not None:
            sampling.setdefault(name, body[name])
    gen_req = GenerateRequest(rid=rid, text=body.get("text"), input_ids=body.get("input_ids"), sampling=sampling)
    if gen_req.text is not None and not isinstance(gen_req.text, str):
        raise ApiError("text must be a string", param="text")
    if gen_req.input_ids is not None and not (isinstance(gen_req.input_ids, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in gen_req.input_ids)):
        raise ApiError("input_ids must be a list of integers", param="input_ids")
    return gen_req


def build_app(service: EntryService, settings: EntrySettings | None = None) -> Starlette:
    """The HTTP application over `service`, guarded as `settings` say (defaults: no key, no CORS)."""
    settings = settings or EntrySettings(served_model=service.served_model)

    @handles_errors
    async def generate(request: Request) -> Response:
        body = await read_json(request)
        gen_req = _generate_request(body)
        wants_logprobs = bool(gen_req.sampling.get("return_logprob") or gen_req.sampling.get("top_logprobs_num"))

        def meta(out: RequestOutput, entries: list[TokenLogprob]) -> dict[str, Any]:
            info = {"id": gen_req.rid, "finish_reason": asdict(out.finish) if out.finish else None,
                    "prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
                    "cached_tokens": out.cached_tokens}
            return {**info, **_logprob_meta(entries)} if wants_logprobs else info

        if not STREAM.read(body, False):
            outputs = await _collect(service, request, gen_req)
            return JSONResponse({"text": "".join(out.text for out in outputs),
                                 "output_ids": [t for out in outputs for t in out.token_ids],
                                 "meta_info": meta(outputs[-1], [e for out in outputs for e in out.logprobs])})
        stream, first = await service.start(request, gen_req)

        async def events() -> AsyncIterator[str]:
            async for out in service.outputs(stream, first):
                if out.error is not None:
                    yield sse(out.error.body())
                    break
                yield sse({"text": out.text, "output_ids": out.token_ids, "meta_info": meta(out, out.logprobs)})
            yield sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream")

    @handles_errors
    async def health(request: Request) -> Response:
        silent = service.liveness.silent_roles()
        if silent:
            raise ApiError(f"no heartbeat within {service.liveness.silence_s:g}s from: {', '.join(silent)}", 503,
                           type="server_error")
        if not service.client.bus.client.is_connected:
            raise ApiError("the entry is not connected to NATS", 503, type="server_error")
        return JSONResponse({"status": "ok", "roles": service.liveness.roles()})

    @handles_errors
    async def server_info(request: Request) -> Response:
        info = await service.scheduler_info()
        return JSONResponse({**asdict(info), "served_model_name": service.served_model, **service.counters(),
                             "actors": service.liveness.actors()})

    async def openapi(request: Request) -> Response:
        return JSONResponse(openapi_document(service.served_model))

    middleware = [Middleware(EntryGuard, settings=settings)]
    if settings.cors_allow_origins:  # outermost, so preflight requests are answered without the API key
        middleware.insert(0, Middleware(CORSMiddleware, allow_origins=settings.cors_allow_origins,
                                        allow_methods=["GET", "POST", "OPTIONS"],
                                        allow_headers=["Authorization", "Content-Type"]))
    return Starlette(routes=[
        *openai_routes(service),
        Route("/generate", generate, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        metrics_route(service),
        Route("/get_server_info", server_info, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
        *control_routes(service),
    ], middleware=middleware, exception_handlers={404: _route_error, 405: _route_error})


async def _route_error(request: Request, exc: Exception) -> Response:
    """Unknown routes and methods answer in OpenAI's error shape too, not Starlette's plain text."""
    status = getattr(exc, "status_code", 404)
    what = "no such route" if status == 404 else f"{request.method} is not allowed here"
    return error_response(ApiError(f"{what}: {request.method} {request.url.path}"[:300], status))
