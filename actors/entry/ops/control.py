"""Operator routes under SGLang's names, each a bus conversation any NATS client can have as well.

`/flush_cache`, `/pause_generation`, `/continue_generation` and `/abort_request` with `abort_all` send a
`ControlCommand` to the scheduler (`{ns}.control.scheduler.command`); `/abort_request` with a `rid` publishes
an `AbortRequest` on `{ns}.abort.{rid}`; `/health_generate` generates one token through the whole ring.
`/update_weights_from_disk` sends the `update_weights_from_disk` command (`model_path`, `mode` "wait", "pause" or
"abort"; SGLang's `abort_all_requests: true` is mode "abort") and waits until the new weights serve; a
checkpoint that does not fit is a 400 and the old weights keep serving. `/v1/load_lora_adapter` (`lora_name`,
`lora_path`: a PEFT directory, under `--lora-dir` when set) and `/v1/unload_lora_adapter` (`lora_name`) serve
and drop LoRA adapters on every replica; a malformed adapter is a 400, an unknown one a 404. Replies are `{"success", "message", **detail}`; a scheduler that does not answer gives 503. The routes that
change state take only `POST` with `Content-Type: application/json` (a body is optional), so a web page the
operator visits cannot trigger them (a cross-origin JSON POST needs a CORS preflight). A body field a route does
not take is a 400 naming it (`check_command_fields`).
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route


from ringserve.bus.errors import ApiError, quote
from ringserve.actors.entry.http_common import handles_errors, read_command
from ringserve.actors.entry.field_checks import Refused, check_top_level
from ringserve.actors.entry.request_flow import EntryService
from ringserve.bus.messages import ControlCommand, ControlReply

LORA_TIMEOUT = 120.0  # seconds to read and check an adapter from disk
UPDATE_WEIGHTS_TIMEOUT = 600.0  # seconds to load a checkpoint and wait for the requests on the old weights
# The body fields each operator route takes (the OpenAPI document describes these); any other is a 400
ABORT_FIELDS = ("rid", "abort_all")
UPDATE_WEIGHTS_FIELDS = ("model_path", "mode", "abort_all_requests", "weight_version")
LOAD_LORA_FIELDS = ("lora_name", "lora_path")
UNLOAD_LORA_FIELDS = ("lora_name",)
# SGLang's fields we do not implement, with why; a null or neutral value passes
PAUSE_MODES = ("in_place",)  # SGLang's pause mode that ours is: running requests keep their KV and resume
PAUSE_REFUSED = {"mode": Refused('only "in_place" is supported: running requests keep their KV and resume; abort '
                                 'them with /abort_request', PAUSE_MODES)}
UPDATE_WEIGHTS_REFUSED = {
    "load_format": Refused('only "auto" is supported: the format is read from model_path', ("auto",)),
    "flush_cache": Refused("the prefix cache is always flushed with the old weights", (True,)),
}


def check_command_fields(body: dict[str, Any], fields: tuple[str, ...],
                         refused: dict[str, Refused] | None = None) -> None:
    """ApiError 400 naming the first field of an operator route's `body` not among `fields` (with its reason
    where `refused` gives one)."""
    takes = f"takes {', '.join(fields)}" if fields else "takes no fields"
    check_top_level(body, fields, (), refused or {},
                    lambda name: ApiError(f"unknown field {quote(name)}; this route {takes}", param=name))


def update_weights_command(body: dict[str, Any]) -> ControlCommand:
    """The `update_weights_from_disk` command of a route body: ours (`model_path`, `mode`, `weight_version`)
    or SGLang's (`abort_all_requests`); ApiError 400 for a field of the wrong type or one it does not take."""
    check_command_fields(body, UPDATE_WEIGHTS_FIELDS, UPDATE_WEIGHTS_REFUSED)
    model_path = body.get("model_path")
    if not isinstance(model_path, str) or not model_path:
        raise ApiError('give "model_path": the .gguf file or safetensors directory to load', param="model_path")
    abort_all = body.get("abort_all_requests", False)
    if not isinstance(abort_all, bool):
        raise ApiError(f"abort_all_requests must be a boolean, got {abort_all!r}", param="abort_all_requests")
    mode = body.get("mode", "abort" if abort_all else "wait")
    if mode not in ("wait", "pause", "abort") or (abort_all and mode != "abort"):
        raise ApiError(f'mode must be "wait", "pause" or "abort" (abort_all_requests means "abort"), got {mode!r}',
                       param="mode")
    version = body.get("weight_version")
    if version is not None and not isinstance(version, str):
        raise ApiError(f"weight_version must be a string, got {version!r}", param="weight_version")
    return ControlCommand(action="update_weights_from_disk", model_path=model_path, mode=mode,
                          weight_version=version)


def control_routes(service: EntryService) -> list[Route]:
    """The operator routes over `service`."""

    def answer(reply: ControlReply) -> Response:
        body: dict[str, Any] = {"success": reply.ok, "message": reply.message, **reply.detail}
        return JSONResponse(body, status_code=200 if reply.ok else 500)

    async def command(action: str) -> Response:
        return answer(await service.command(action))

    @handles_errors
    async def flush_cache(request: Request) -> Response:
        check_command_fields(await read_command(request), ())
        return await command("flush_cache")

    @handles_errors
    async def pause_generation(request: Request) -> Response:
        check_command_fields(await read_command(request), (), PAUSE_REFUSED)
        return await command("pause")

    @handles_errors
    async def continue_generation(request: Request) -> Response:
        check_command_fields(await read_command(request), ())
        return await command("continue")

    @handles_errors
    async def abort_request(request: Request) -> Response:
        body = await read_command(request)
        check_command_fields(body, ABORT_FIELDS)
        abort_all = body.get("abort_all", False)
        if not isinstance(abort_all, bool):
            raise ApiError(f"abort_all must be a boolean, got {abort_all!r}", param="abort_all")
        if abort_all:
            return await command("abort_all")
        if body.get("rid") is None:
            raise ApiError('give the "rid" of the request to abort, or "abort_all": true', param="rid")
        rids = await service.abort(body["rid"])
        return JSONResponse({"success": True, "message": f"abort sent for {', '.join(rids)}", "rids": rids})

    @handles_errors
    async def update_weights_from_disk(request: Request) -> Response:
        reply = await service.command(update_weights_command(await read_command(request)), UPDATE_WEIGHTS_TIMEOUT)
        if reply.error is not None:
            raise reply.error
        return answer(reply)

    async def lora_command(request: Request, action: str, fields: tuple[str, ...]) -> Response:
        body = await read_command(request)
        check_command_fields(body, fields)
        for name in fields:
            if not isinstance(body.get(name), str) or not body[name]:
                raise ApiError(f"{name} must be a non-empty string", param=name)
        reply = await service.command(ControlCommand(action=action, lora_name=body["lora_name"],
                                                     lora_path=body.get("lora_path")), LORA_TIMEOUT)
        if reply.error is not None:
            raise reply.error
        return answer(reply)

    @handles_errors
    async def load_lora_adapter(request: Request) -> Response:
        return await lora_command(request, "load_lora_adapter", LOAD_LORA_FIELDS)

    @handles_errors
    async def unload_lora_adapter(request: Request) -> Response:
        return await lora_command(request, "unload_lora_adapter", UNLOAD_LORA_FIELDS)

    @handles_errors
    async def health_generate(request: Request) -> Response:
        await service.health_generate()
        return JSONResponse({"status": "ok"})

    return [
        Route("/flush_cache", flush_cache, methods=["POST"]),
        Route("/pause_generation", pause_generation, methods=["POST"]),
        Route("/continue_generation", continue_generation, methods=["POST"]),
        Route("/abort_request", abort_request, methods=["POST"]),
        Route("/update_weights_from_disk", update_weights_from_disk, methods=["POST"]),
        Route("/health_generate", health_generate, methods=["GET"]),
        Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
        Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"]),
    ]
