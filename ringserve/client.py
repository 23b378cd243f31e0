"""`ringserve.Client`: the async Python client of a running ring, over NATS (no HTTP).

Two identities: a NATS client `c` (a user from `ringserve serve --nats-client c` or `ringserve nats-config
--client c`) submits on its own `{ns}.client.c.*` subjects and can only generate and abort its own requests;
without a client name the Client speaks on the unscoped subjects as the HTTP entry does (the `Engine`, or any
process with the entry role's credentials, or anyone on a NATS without auth), which also allows the operator
commands (flush the cache, pause, update weights, server info). A client's credentials file (JSON) notes its
name, namespace and URL, so `Client(creds="client-c.json")` needs nothing else.

Errors are the HTTP API's: `bus.errors.ApiError` with the same message, `code` (the HTTP status) and `param`.
A request refused because the ring is at its admission cap (503 with `retry_after`) is retried after that
many seconds, up to `busy_retries` times; the requests of a list run `max_in_flight` at a time, so a batch of
any size flows through the scheduler's continuous batching without tripping the caps.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Sequence
from urllib.parse import urlsplit

from bus.connection import BusConnection
from bus.credentials import NatsCredentials, load_credentials_file
from bus.errors import ApiError, server_error
from bus.messages import ControlReply, GenerateRequest, RequestOutput
from bus.replica_replies import combined_info, replica_entry
from bus.permissions import CLIENT_ROLE, inbox_prefix
from bus.ring_client import OPERATOR_ABORT, RequestStream, RingClient, RingUnavailable
from bus.subjects import SCOPE_SEPARATOR, InvalidRidError, Subjects, validate_rid
from ringserve.requests import chat_request, generate_requests
from ringserve.results import ChatResult, GenerateDelta, GenerateResult

log = logging.getLogger("ringserve")
DEFAULT_URL = "nats://127.0.0.1:4222"
CLIENT_IN_FLIGHT = 128  # below the scheduler's default --max-client-requests (256)
ENTRY_IN_FLIGHT = 512  # below its default --max-live-requests (1024)
CONTROL_TIMEOUT = 10.0
UPDATE_TIMEOUT = 600.0  # loading a checkpoint and waiting for the requests on the old weights
RECONNECT_ATTEMPTS = 60  # once connected: as the actors, ~30 s of NATS outage before the connection is given up


def _credential_notes(path: str | Path) -> dict[str, Any]:
    """The notes of a ringserve JSON credentials file (`client`, `namespace`, `url`); {} for a NATS .creds file."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


class Client:
    """An async connection to one ring (one namespace on one NATS); use `async with Client(...) as client`."""

    def __init__(self, nats_url: str | None = None, namespace: str | None = None, creds: str | Path | None = None,
                 *, client: str | None = None, credentials: NatsCredentials | None = None,
                 submit_timeout: float = 30.0, stall_timeout: float | None = None, max_in_flight: int | None = None,
                 busy_retries: int = 30, served_model: str | None = None, name: str = "ringserve-client") -> None:
        """`creds`: a credentials file (ringserve JSON or a NATS .creds file); its notes give the defaults of
        `nats_url` (else nats://127.0.0.1:4222), `namespace` (else "ringserve") and `client` (else unscoped).
        `credentials`: the same, already loaded (the Engine passes the entry role's). `stall_timeout`: seconds
        a request may go without output before it fails with a 503 (None: never). `served_model`: the model
        name chat responses carry (default: the scheduler's, or the namespace)."""
        notes = _credential_notes(creds) if creds is not None else {}
        self.url = nats_url or notes.get("url") or DEFAULT_URL
        self.subjects = Subjects(namespace or notes.get("namespace") or "ringserve")
        self.client = validate_rid(client) if client is not None else notes.get("client")
        self._credentials = credentials if credentials is not None else (
            load_credentials_file(creds) if creds is not None else None)
        self.submit_timeout = submit_timeout
        self.stall_timeout = stall_timeout
        self.max_in_flight = max_in_flight or (CLIENT_IN_FLIGHT if self.client else ENTRY_IN_FLIGHT)
        self.busy_retries = busy_retries
        self.served_model = served_model
        self._name = name
        self._ring: RingClient | None = None
        self._live: dict[str, RequestStream] = {}

    # --- connection ---------------------------------------------------------------------------------------

    async def connect(self) -> "Client":
        """Connect to NATS; raises ConnectionError saying why it failed (no server, refused credentials)."""
        if self._ring is not None:
            return self
        namespace = self.subjects.namespace
        inbox = inbox_prefix(namespace, CLIENT_ROLE, self.client) if self.client else inbox_prefix(namespace, "entry")
        try:
            bus = await BusConnection.connect(self.url, self._name, credentials=self._credentials, inbox_prefix=inbox,
                                              max_reconnect_attempts=1)
        except Exception as exc:  # nats-py raises unrelated types for a refused, absent or unauthorized server
            raise ConnectionError(f"cannot connect to NATS at {self.url}: {await self._why_refused()} "
                                  f"({exc!r})") from exc
        bus.client.options["max_reconnect_attempts"] = RECONNECT_ATTEMPTS  # fail fast at first, then ride out blips
        self._ring = RingClient(bus, self.subjects, self.submit_timeout, self.stall_timeout, client=self.client)
        if not self.client:  # an operator: commands go to every replica, so count them
            await self._ring.track_replicas()
        return self

    async def _why_refused(self) -> str:
        """Why the connection failed: nothing listens there, or the server refused these credentials."""
        first = urlsplit(self.url.split(",")[0].strip())
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(first.hostname, first.port or 4222), 3)
        except (OSError, asyncio.TimeoutError):
            return "no NATS server answers there"
        writer.close()
        if self._credentials is None:
            return ("the server refused the connection: a NATS with auth needs credentials (creds=FILE; "
                    "`ringserve submit --creds FILE`), e.g. a client's file, which `ringserve serve --nats-client "
                    "NAME` writes and logs (`nats client credentials client=NAME file=...`)")
        return "the server refused these credentials, or the TLS settings"

    async def close(self) -> None:
        """Abort every request still running and close the connection."""
        ring, self._ring = self._ring, None
        if ring is None:
            return
        for stream in list(self._live.values()):
            with contextlib.suppress(Exception):
                await stream.abort("client closed")
        self._live.clear()
        with contextlib.suppress(Exception):
            await ring.bus.close()

    async def fail_all(self, error: ApiError) -> None:
        """End every running request with `error` now (and abort it): what the Engine does when the ring dies."""
        for stream in list(self._live.values()):
            with contextlib.suppress(Exception):
                await stream.fail(error, "ring failed")

    async def __aenter__(self) -> "Client":
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def ring(self) -> RingClient:
        if self._ring is None:
            raise RuntimeError("the Client is not connected: use `async with Client(...)` or `await client.connect()`")
        return self._ring

    @property
    def live_requests(self) -> int:
        """Requests of this client not finished yet."""
        return len(self._live)

    # --- generation ---------------------------------------------------------------------------------------

    async def generate(self, prompt: str | Sequence[str] | None = None,
                       sampling_params: dict[str, Any] | Sequence[dict[str, Any]] | None = None, *,
                       input_ids: list[int] | list[list[int]] | None = None, rid: str | Sequence[str] | None = None,
                       return_logprob: bool | None = None, top_logprobs_num: int | None = None,
                       logprob_start_len: int | None = None, timeout: float | None = None,
                       on_result: Callable[[int, GenerateResult], None] | None = None,
                       ) -> GenerateResult | list[GenerateResult]:
        """Generate for one prompt (a result) or a list (results in prompt order), as `/generate` does.

        `on_result(i, result)` is called as each request of a list finishes (a progress bar). Raises ApiError:
        the first failing request's error (the others are aborted), or a 504 after `timeout` seconds.
        """
        requests, listed = generate_requests(prompt, sampling_params, input_ids, rid, return_logprob=return_logprob,
                                             top_logprobs_num=top_logprobs_num, logprob_start_len=logprob_start_len)
        results = await self.run_all(requests, timeout, on_result)
        return results if listed else results[0]

    def stream(self, prompt: str | Sequence[str] | None = None,
               sampling_params: dict[str, Any] | Sequence[dict[str, Any]] | None = None, *,
               input_ids: list[int] | list[list[int]] | None = None, rid: str | Sequence[str] | None = None,
               return_logprob: bool | None = None, top_logprobs_num: int | None = None,
               logprob_start_len: int | None = None) -> AsyncIterator[GenerateDelta]:
        """The deltas of one prompt (or of a list, each with its `index`) as they arrive; closing the iterator
        early aborts the requests. An error output raises its ApiError."""
        requests, _ = generate_requests(prompt, sampling_params, input_ids, rid, return_logprob=return_logprob,
                                        top_logprobs_num=top_logprobs_num, logprob_start_len=logprob_start_len)
        return self.stream_requests(requests)

    async def chat(self, messages: list[dict[str, Any]], sampling_params: dict[str, Any] | None = None, *,
                   rid: str | None = None, timeout: float | None = None, **openai_fields: Any) -> ChatResult:
        """A chat completion, as `/v1/chat/completions` answers it (`response`), with the chat template, tools
        (`tools`, `tool_choice`), structured output (`response_format`) and OpenAI's names (`max_tokens`,
        `temperature`, ...); `sampling_params` adds native parameters."""
        from actors.entry.openai_protocol import full_response

        request, options = chat_request(messages, rid, await self._model_name(), sampling_params, openai_fields)
        outputs = await self._with_timeout(self._collect_outputs(request), timeout, [request.rid])
        response = full_response(request.rid, options, [outputs])
        message = response["choices"][0]["message"]
        base = GenerateResult.from_outputs(request.rid, outputs, request.sampling)
        return ChatResult(message.get("content") or "", base.output_ids, base.meta_info, message, response)

    def chat_stream(self, messages: list[dict[str, Any]], sampling_params: dict[str, Any] | None = None, *,
                    rid: str | None = None, model: str = "", **openai_fields: Any) -> AsyncIterator[GenerateDelta]:
        """The text deltas of a chat completion as they arrive (tool calls are not parsed out of them)."""
        request, _ = chat_request(messages, rid, model, sampling_params, openai_fields)
        return self.stream_requests([request])

    async def run_all(self, requests: list[GenerateRequest], timeout: float | None = None,
                      on_result: Callable[[int, GenerateResult], None] | None = None) -> list[GenerateResult]:
        """Run `requests` (`max_in_flight` at a time) and return their results in order."""
        window = asyncio.Semaphore(self.max_in_flight)

        async def one(i: int, request: GenerateRequest) -> GenerateResult:
            async with window:
                outputs = await self._collect_outputs(request)
            result = GenerateResult.from_outputs(request.rid, outputs, request.sampling)
            if on_result is not None:
                on_result(i, result)
            return result

        return await self._with_timeout(self._gather([one(i, r) for i, r in enumerate(requests)]), timeout,
                                        [r.rid for r in requests])

    async def stream_requests(self, requests: list[GenerateRequest]) -> AsyncIterator[GenerateDelta]:
        """Every output of `requests` as a delta, as it arrives (each request's in order)."""
        queue: asyncio.Queue[tuple[int, RequestOutput | Exception]] = asyncio.Queue()

        async def pump(i: int, request: GenerateRequest) -> None:
            try:
                async with contextlib.aclosing(self.outputs(request)) as outputs:
                    async for out in outputs:
                        await queue.put((i, out))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # handed to the reader, which raises it
                await queue.put((i, exc))

        tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(requests)]
        remaining = len(requests)
        try:
            while remaining:
                i, item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                if item.error is not None:
                    raise item.error
                if item.is_last:
                    remaining -= 1
                yield GenerateDelta.from_output(self._local(item.rid), item, requests[i].sampling, i)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _gather(self, coros: list[Any]) -> list[Any]:
        """Every coroutine's result; on the first failure the others are cancelled (their requests aborted)."""
        tasks = [asyncio.ensure_future(c) for c in coros]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _with_timeout(self, coro: Any, timeout: float | None, rids: list[str]) -> Any:
        try:
            return await asyncio.wait_for(coro, timeout)
        except asyncio.TimeoutError:
            what = rids[0] if len(rids) == 1 else f"{len(rids)} requests"
            raise server_error(f"{what} did not finish within {timeout:g}s (aborted)", 504) from None

    async def _collect_outputs(self, request: GenerateRequest) -> list[RequestOutput]:
        """All outputs of one request; raises the ApiError of an error output. Nothing reads the outputs as
        they come, so the request says so (`stream=False`: fewer, larger outputs)."""
        async with contextlib.aclosing(self.outputs(replace(request, stream=False))) as stream:
            outputs = [out async for out in stream]
        if outputs[-1].error is not None:
            raise outputs[-1].error
        return outputs

    async def outputs(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Submit `request` and yield the ring's RequestOutput messages for it as they arrive, the last one
        terminal (`finish` or `error`); a refusal because the ring is busy is retried (`busy_retries`). Closing
        the iterator early (`contextlib.aclosing`) aborts the request."""
        ring = self.ring
        for attempt in range(self.busy_retries + 1):
            stream = ring.stream(request.rid)
            if stream.rid in self._live:
                raise ApiError(f"request id {request.rid!r} is already in use", param="rid")
            self._live[stream.rid] = stream
            try:
                try:
                    await ring.open(stream, request)
                except RingUnavailable as exc:
                    raise ApiError(str(exc), 503, type="server_error") from exc
                first = await stream.next()
                busy = first.error is not None and first.error.retry_after is not None
                if busy and attempt < self.busy_retries:
                    await asyncio.sleep(first.error.retry_after or 1)  # type: ignore[union-attr]
                    continue
                yield first
                while not stream.finished:
                    yield await stream.next()
                return
            finally:
                del self._live[stream.rid]
                if not stream.finished:
                    await asyncio.shield(stream.abort("client"))

    def _local(self, ring_rid: str) -> str:
        """The rid this client chose, from the rid inside the ring (`c~rid` for a client's request)."""
        return ring_rid.split(SCOPE_SEPARATOR, 1)[1] if self.client and SCOPE_SEPARATOR in ring_rid else ring_rid

    # --- aborts and operator commands ---------------------------------------------------------------------

    async def abort(self, rid: str) -> None:
        """Stop request `rid` and free its KV now; it ends with finish reason "abort" (a client: its own only)."""
        try:
            ring_rid = self.ring.stream(rid).rid  # the scoped rid for a client
        except InvalidRidError as exc:
            raise ApiError(str(exc), param="rid") from exc
        await self.ring.abort(ring_rid, OPERATOR_ABORT)

    async def command(self, action: str, timeout: float = CONTROL_TIMEOUT, **arguments: Any) -> dict[str, Any]:
        """Send an operator command (bus/messages.py `ControlCommand`) to every scheduler replica and answer as the
        HTTP control routes do: `{"success", "message", **detail}`; raises its ApiError when a replica refused it,
        or when not every replica did it."""
        self._operator_only(action)
        try:
            reply: ControlReply = await self.ring.command(action, timeout, expected=await self.ring.replicas_to_ask(),
                                                          **arguments)
        except asyncio.TimeoutError as exc:
            raise server_error(f"the scheduler did not answer: {exc}", 503) from exc
        if reply.error is not None:
            raise reply.error
        if not reply.ok:
            raise server_error(reply.message or f"{action} failed")
        return {"success": reply.ok, "message": reply.message, **reply.detail}

    async def flush_cache(self) -> dict[str, Any]:
        """Drop every cached prefix no running request uses (`freed_tokens`)."""
        return await self.command("flush_cache")

    async def pause_generation(self) -> dict[str, Any]:
        """Stop stepping: running requests keep their KV, new ones queue."""
        return await self.command("pause")

    async def continue_generation(self) -> dict[str, Any]:
        """Step again after `pause_generation`."""
        return await self.command("continue")

    async def abort_all(self) -> dict[str, Any]:
        """Abort every request in the ring (`aborted`)."""
        return await self.command("abort_all")

    async def update_weights_from_disk(self, model_path: str, mode: str = "wait", weight_version: str | None = None,
                                       timeout: float = UPDATE_TIMEOUT) -> dict[str, Any]:
        """Load the checkpoint at `model_path` (same architecture: a .gguf file or a safetensors directory) and
        swap it in; `mode` "wait" (running requests finish first), "pause" (they pause and resume on the new
        weights) or "abort". Returns `weight_version`, `model_path` and counts; raises ApiError 400 for a
        checkpoint that does not fit (the old weights keep serving)."""
        return await self.command("update_weights_from_disk", timeout, model_path=str(model_path), mode=mode,
                                  weight_version=weight_version)

    async def get_server_info(self) -> dict[str, Any]:
        """The scheduler's load and settings (as in `/get_server_info`), with `model_path` and `weight_version`."""
        self._operator_only("get_server_info")
        try:
            infos = await self.ring.infos(await self.ring.replicas_to_ask(), CONTROL_TIMEOUT)
        except asyncio.TimeoutError as exc:
            raise server_error(f"the scheduler did not answer: {exc}", 503) from exc
        info = combined_info(infos)
        return {**asdict(info), "max_total_num_tokens": info.kv_total_tokens, "model_path": info.model,
                "replicas": [replica_entry(i) for i in infos]}

    def _operator_only(self, action: str) -> None:
        if self.client:
            raise ApiError(f"{action} is an operator command; NATS client {self.client!r} may only generate and "
                           "abort its own requests", 403, type="permission_error")

    async def _model_name(self) -> str:
        if self.served_model is None:
            self.served_model = self.subjects.namespace
            if not self.client:
                with contextlib.suppress(ApiError):
                    self.served_model = (await self.get_server_info())["model"] or self.served_model
        return self.served_model
