"""The Starlette app: OpenAI-compatible `/v1/*`, Anthropic's `/v1/messages`, native `/generate`
(actors/entry/native/generate.py), `/health`, `/metrics`, `/get_server_info`, `/get_model_info`, `/openapi.json`,
and the operator routes (`/flush_cache`, `/abort_request`, `/pause_generation`, ...), behind the guard (API key,
body limit) and, when origins are configured, CORS."""

from __future__ import annotations

from dataclasses import asdict

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ringserve.actors.entry.anthropic import errors as anthropic_errors
from ringserve.actors.entry.anthropic.request import MESSAGES_PATH
from ringserve.actors.entry.anthropic.routes import anthropic_routes
from ringserve.actors.entry.ops.control import control_routes
from ringserve.actors.entry.openai.embeddings import embeddings_route
from ringserve.actors.entry.errors import error_response
from ringserve.bus.errors import ApiError
from ringserve.actors.entry.guard import EntryGuard
from ringserve.actors.entry.native.generate import generate_route
from ringserve.actors.entry.http_common import handles_errors, package_version
from ringserve.actors.entry.image_input import ImageIntake
from ringserve.actors.entry.ops.metrics_route import metrics_route
from ringserve.actors.entry.openapi.document import openapi_document
from ringserve.actors.entry.openai.routes import openai_routes
from ringserve.actors.entry.request_flow import EntryService
from ringserve.actors.entry.responses.routes import responses_routes
from ringserve.bus.image_store import ImageStore
from ringserve.bus.replica_replies import combined_info, replica_entry
from ringserve.actors.entry.settings import EntrySettings
from ringserve.actors.entry.native.tokenize import ask_tokenizer, tokenize_routes
from ringserve.bus.tokenize_messages import TokenizeQuery



def build_app(service: EntryService, settings: EntrySettings | None = None) -> Starlette:
    """The HTTP application over `service`, guarded as `settings` say (defaults: no key, no CORS)."""
    settings = settings or EntrySettings(served_model=service.served_model)
    service.images = ImageIntake(ImageStore(lambda: service.client.bus.client, service.client.subjects.namespace,
                                            settings.image_ttl, settings.image_store_max_bytes), settings.images)

    @handles_errors
    async def health(request: Request) -> Response:
        if service.draining:  # a load balancer stops sending here
            raise ApiError("this entry is shutting down", 503, type="server_error")
        silent = service.liveness.silent_roles()
        if silent:
            raise ApiError(f"no heartbeat within {service.liveness.silence_s:g}s from: {', '.join(silent)}", 503,
                           type="server_error")
        if not service.client.bus.client.is_connected:
            raise ApiError("the entry is not connected to NATS", 503, type="server_error")
        return JSONResponse({"status": "ok", "roles": service.liveness.roles()})

    @handles_errors
    async def server_info(request: Request) -> Response:
        infos = await service.scheduler_infos()
        info = combined_info(infos)
        replicas = [replica_entry(i) for i in infos]
        # SGLang's names too: max_total_num_tokens, version, model_path
        return JSONResponse({**asdict(info), "replicas": replicas, "served_model_name": service.served_model,
                             **service.counters(),
                             "actors": service.liveness.actors(), "heartbeat_timeout": service.liveness.silence_s,
                             "max_total_num_tokens": info.kv_total_tokens,
                             "tool_call_parser": settings.tool_call_parser,
                             "version": package_version(), "model_path": info.model or service.served_model})

    @handles_errors
    async def model_info(request: Request) -> Response:
        info = await service.scheduler_info()
        path = info.model or service.served_model
        tokenizer = await ask_tokenizer(service, TokenizeQuery(model_info=True))  # what requests are served with
        return JSONResponse({"model_path": path, "tokenizer_path": path, "is_generation": True,
                             "default_sampling_params": tokenizer.default_sampling_params,
                             "reasoning_parser": tokenizer.reasoning_parser})

    async def openapi(request: Request) -> Response:
        return JSONResponse(openapi_document(service.served_model))

    middleware = [Middleware(EntryGuard, settings=settings)]
    if settings.cors_allow_origins:  # outermost, so preflight requests are answered without the API key
        middleware.insert(0, Middleware(CORSMiddleware, allow_origins=settings.cors_allow_origins,
                                        allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
                                        allow_headers=["Authorization", "Content-Type", "X-Api-Key",
                                                       "Anthropic-Version", "Anthropic-Beta"]))
    return Starlette(routes=[
        *openai_routes(service, settings.tool_call_parser),
        *anthropic_routes(service, settings.tool_call_parser),
        *responses_routes(service, settings),
        generate_route(service),
        embeddings_route(service),
        Route("/health", health, methods=["GET"]),
        metrics_route(service),
        Route("/get_server_info", server_info, methods=["GET"]),
        Route("/get_model_info", model_info, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
        *control_routes(service),
        *tokenize_routes(service),
    ], middleware=middleware, exception_handlers={404: _route_error, 405: _route_error})


async def _route_error(request: Request, exc: Exception) -> Response:
    """Unknown routes and methods answer in OpenAI's error shape too (Anthropic's under /v1/messages), not
    Starlette's plain text."""
    status = getattr(exc, "status_code", 404)
    what = "no such route" if status == 404 else f"{request.method} is not allowed here"
    error = ApiError(f"{what}: {request.method} {request.url.path}"[:300], status)
    if request.url.path.startswith(MESSAGES_PATH):
        return anthropic_errors.error_response(error)
    return error_response(error)
