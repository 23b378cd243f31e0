"""OpenAI's Responses API: `POST /v1/responses` (answered whole, streamed as Responses events, or in the
background), `GET` and `DELETE /v1/responses/{id}`, `POST /v1/responses/{id}/cancel` and
`GET /v1/responses/{id}/input_items`.

Stored responses live in the bus's key-value bucket (`ringserve.bus.response_store`), so any entry replica
reads, continues (`previous_response_id`) and cancels any of them; a running one is cancelled by aborting its
ring request by rid over the bus. With API keys on, a record keeps a hash of the key that created it, and only
that key reaches it (others get the 404 of a response that does not exist).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import re
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ringserve.actors.entry.responses import protocol as rp
from ringserve.actors.entry.choices import ChoiceGroup
from ringserve.actors.entry.http_common import handles_errors, read_json
from ringserve.actors.entry.request_flow import EntryService
from ringserve.actors.entry.responses.events import OutputItems
from ringserve.actors.entry.settings import EntrySettings
from ringserve.bus.errors import ApiError
from ringserve.bus.messages import GenerateRequest
from ringserve.bus.response_store import ResponseStore, StoreUnavailable, key_hash
from ringserve.bus.ring_client import OPERATOR_ABORT
from ringserve.bus.subjects import new_rid

log = logging.getLogger("entry")
RUNNING = ("queued", "in_progress")
RESPONSE_ID = re.compile(r"^resp_[A-Za-z0-9_-]{1,64}$")
# what the ring names (by OpenAI's chat names), as a Responses body names it
RING_NAMES = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens", "messages": "input",
              "response_format": "text", "json_schema": "text", "structural_tag": "tools"}
MAX_LIST = 100


def presented_key(request: Request) -> str | None:
    """The API key the request carries (the guard has checked it): Bearer, or Anthropic's x-api-key."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return (request.headers.get("x-api-key") or "").strip() or None


def _not_found(response_id: str, param: str | None = None) -> ApiError:
    where = f"{param}: " if param else ""
    return ApiError(f"{where}Response with id '{response_id[:100]}' not found.", 404, param=param)


async def _noop_receive() -> dict[str, Any]:
    await asyncio.Event().wait()  # never: a background response has no client to lose
    return {"type": "http.disconnect"}


def detached(request: Request) -> Request:
    """A request with the headers (the trace context) of `request` but no client: it never disconnects."""
    return Request({"type": "http", "method": "POST", "path": request.url.path, "headers": request.scope["headers"],
                    "query_string": b""}, receive=_noop_receive)


class Responses:
    """The routes' state: the ring, the store, the background tasks this entry runs."""

    def __init__(self, service: EntryService, settings: EntrySettings, store: ResponseStore) -> None:
        self.service = service
        self.settings = settings
        self.store = store
        self.tasks: set[asyncio.Task[None]] = set()

    def owner(self, request: Request) -> str | None:
        return key_hash(presented_key(request)) if self.settings.api_key else None

    async def _call(self, awaitable: Any) -> Any:
        try:
            return await awaitable
        except StoreUnavailable as exc:
            raise ApiError(str(exc), 503, type="server_error") from exc

    async def load(self, request: Request, response_id: str, param: str | None = None) -> dict[str, Any]:
        """The stored record `response_id`, if the caller's key may reach it; else the 404 of a missing one."""
        if not isinstance(response_id, str):
            raise ApiError(f"{param or 'response_id'} must be a string", param=param)
        if not RESPONSE_ID.match(response_id):  # not one of ours: no key of the bucket
            raise _not_found(response_id, param)
        stored = await self._call(self.store.get(response_id))
        if stored is None:
            raise _not_found(response_id, param)
        owner, caller = stored.get("owner"), self.owner(request)
        if owner is not None and (caller is None or not hmac.compare_digest(owner, caller)):
            raise _not_found(response_id, param)
        return stored

    async def save(self, options: rp.ResponseOptions, body: dict[str, Any], owner: str | None) -> None:
        if options.store:
            await self._call(self.store.put(rp.record(options, body, owner)))

    async def create(self, request: Request) -> Response:
        body = await read_json(request)
        previous_id = body.get("previous_response_id")
        previous = None if previous_id is None else await self.load(request, previous_id, "previous_response_id")
        gen_req, options = rp.parse_body(body, new_rid(), self.service.served_model,
                                         self.settings.tool_call_parser, previous)
        await self.service.require_adapter(options.lora_name, body.get("model"))
        owner = self.owner(request)
        if options.background:
            queued = rp.response_object(options, "queued", [])
            await self.save(options, queued, owner)
            self.spawn(self._background(detached(request), gen_req, options, owner))
            return JSONResponse(queued)
        group = await self.start(request, gen_req, options)
        try:
            await self.save(options, rp.response_object(options, "in_progress", []), owner)
        except BaseException:
            await group.close()
            raise
        if options.stream:
            return StreamingResponse(self._events(group, options, owner), media_type="text/event-stream")
        answer = await self._whole(request, group, options, owner)
        await self.save(options, answer, owner)
        return JSONResponse(answer)

    async def _whole(self, request: Request, group: ChoiceGroup, options: rp.ResponseOptions,
                     owner: str | None) -> dict[str, Any]:
        """The response read whole; a failure is stored as the failed response, then raised."""
        items = OutputItems(options)
        try:
            [outputs] = await group.collect(request)
        except ApiError as exc:
            await self._save_quietly(options, items.failed(exc)[1], owner)
            raise
        for out in outputs:
            items.feed(out)
        return items.result()[1]

    async def start(self, request: Request, gen_req: GenerateRequest, options: rp.ResponseOptions) -> ChoiceGroup:
        """The request on the ring; its errors name the field as the Responses body does."""
        if self.service.images is not None:
            await self.service.images.resolve_all([gen_req])
        try:
            return await ChoiceGroup.start(self.service, request, [gen_req], 1)
        except ApiError as exc:
            if exc.param in RING_NAMES:
                forced = options.tools is not None and options.tools.choice != "auto"
                exc.param = "tools" if forced and RING_NAMES[exc.param] == "text" else RING_NAMES[exc.param]
            raise

    async def _events(self, group: ChoiceGroup, options: rp.ResponseOptions, owner: str | None) -> AsyncIterator[str]:
        items = OutputItems(options)
        ended = False
        try:
            yield items.start()
            async with contextlib.aclosing(group.merged()) as outputs:
                async for _, out in outputs:
                    if out.error is not None:
                        ended = True
                        event, failed = items.failed(out.error)
                        await self._save_quietly(options, failed, owner)
                        yield event
                        return
                    yield items.feed(out)
            ended = True
            await self._save_quietly(options, items.result()[1], owner)
            yield items.end()
        finally:
            if not ended:  # the client went away (its ring request is aborted): the stored one ends cancelled
                self.spawn(self._save_quietly(options, rp.response_object(options, "cancelled", items.items), owner))

    def spawn(self, work: Any) -> None:
        """Run `work` as a task of this entry's, kept until it is done."""
        task = asyncio.get_running_loop().create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _save_quietly(self, options: rp.ResponseOptions, body: dict[str, Any], owner: str | None) -> None:
        """Store a streamed or background response's end; a store failure is logged (the stream has begun)."""
        try:
            await self.save(options, body, owner)
        except ApiError as exc:
            log.warning("could not store response %s: %s", options.id, exc.message)

    async def _background(self, request: Request, gen_req: GenerateRequest, options: rp.ResponseOptions,
                          owner: str | None) -> None:
        stored = None
        try:
            group = await self.start(request, gen_req, options)
        except ApiError as exc:
            await self._save_quietly(options, OutputItems(options).failed(exc)[1], owner)
            return
        with contextlib.suppress(StoreUnavailable):
            stored = await self.store.get(options.id)
        if stored is not None and stored.get("status") == "cancelled":  # cancelled while it was being submitted:
            await group.close()  # the cancel's abort may have come before the request reached a scheduler
            return
        await self._save_quietly(options, rp.response_object(options, "in_progress", []), owner)
        try:
            answer = await self._whole(request, group, options, owner)
        except ApiError:
            return
        with contextlib.suppress(StoreUnavailable):
            stored = await self.store.get(options.id)
        if stored is not None and stored.get("status") == "cancelled":  # cancelled before its request ran
            answer["status"] = "cancelled"
        await self._save_quietly(options, answer, owner)

    async def retrieve(self, request: Request) -> Response:
        return JSONResponse(rp.public(await self.load(request, request.path_params["response_id"])))

    async def delete(self, request: Request) -> Response:
        stored = await self.load(request, request.path_params["response_id"])
        await self._call(self.store.delete(stored["id"]))
        return JSONResponse({"id": stored["id"], "object": "response", "deleted": True})

    async def cancel(self, request: Request) -> Response:
        if (await request.body()).strip():  # OpenAI's cancel takes no body: a field in one is a 400
            unknown = next(iter(await read_json(request)), None)
            if unknown is not None:
                raise rp.unknown_parameter(unknown)
        stored = await self.load(request, request.path_params["response_id"])
        if stored["status"] not in RUNNING:
            raise ApiError(f"Cannot cancel a response with status {stored['status']}: only a running one can be "
                           "cancelled.", param="response_id")
        await self.service.client.abort(stored["rid"], OPERATOR_ABORT)  # whichever entry runs it
        stored["status"] = "cancelled"
        await self._call(self.store.put(stored))
        return JSONResponse(rp.public(stored))

    async def input_items(self, request: Request) -> Response:
        stored = await self.load(request, request.path_params["response_id"])
        query = request.query_params
        unknown = next((name for name in query if name not in ("order", "limit", "after", "include")), None)
        if unknown is not None:
            raise rp.unknown_parameter(unknown)
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise ApiError("order must be asc or desc", param="order")
        limit = query.get("limit", "20")
        if not limit.isdigit() or not 1 <= int(limit) <= MAX_LIST:
            raise ApiError(f"limit must be an integer from 1 to {MAX_LIST}", param="limit")
        if query.get("include"):
            raise ApiError(f"include: {rp.REFUSED['include'].reason}", param="include")
        data = list(stored["input_items"] if order == "asc" else reversed(stored["input_items"]))
        after = query.get("after")
        if after is not None:
            ids = [item["id"] for item in data]
            if after not in ids:
                raise ApiError(f"after: no input item {after[:64]!r} in this response", param="after")
            data = data[ids.index(after) + 1:]
        page = data[:int(limit)]
        return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None, "has_more": len(data) > len(page)})


def responses_routes(service: EntryService, settings: EntrySettings) -> list[Route]:
    """The Responses routes over `service`, storing in the namespace's bucket on the entry's NATS connection."""
    store = ResponseStore(lambda: service.client.bus.client, service.client.subjects.namespace, settings.responses_ttl,
                          settings.responses_max_bytes)
    api = Responses(service, settings, store)
    one = rp.RESPONSES_PATH + "/{response_id}"
    return [Route(rp.RESPONSES_PATH, handles_errors(api.create), methods=["POST"]),
            Route(one, handles_errors(api.retrieve), methods=["GET"]),
            Route(one, handles_errors(api.delete), methods=["DELETE"]),
            Route(one + "/cancel", handles_errors(api.cancel), methods=["POST"]),
            Route(one + "/input_items", handles_errors(api.input_items), methods=["GET"])]
