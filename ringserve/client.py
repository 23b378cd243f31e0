"""`ringserve.Client`: the async Python client of a running ring, over NATS (no HTTP).

Two identities: a NATS client `c` (a user from `ringserve serve --nats-client c` or `ringserve nats-config
--client c`) submits on its own `{ns}.client.c.*` subjects and can only generate and abort its own requests;
without a client name the Client speaks on the unscoped subjects as the HTTP entry does (the `Engine`, or any
process with the entry role's credentials, or anyone on a NATS without auth), which also allows the operator
commands (flush the cache, pause, update weights, server info). A client's credentials file (JSON) notes its
name, namespace and URL, so `Client(creds="client-c.json")` needs nothing else.

Errors are the HTTP API's: `ringserve.bus.errors.ApiError` with the same message, `code` (the HTTP status) and `param`.
A request refused because the ring is at its admission cap (503 with `retry_after`) is retried after that
many seconds, up to `busy_retries` times; the requests of a list run `max_in_flight` at a time, so a batch of
any size flows through the scheduler's continuous batching without tripping the caps.
Connecting, submitting and reading outputs are `ringserve.bus.ring_session.RingSession`'s, which `ringserve submit`
shares.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import asdict, replace
from typing import Any, AsyncIterator, Callable, Sequence

from ringserve.bus.errors import ApiError, server_error
from ringserve.bus.messages import ControlReply, GenerateRequest, RequestOutput
from ringserve.bus.replica_replies import combined_info, replica_entry
from ringserve.bus.ring_client import OPERATOR_ABORT
from ringserve.bus.ring_session import RingSession
from ringserve.bus.subjects import SCOPE_SEPARATOR, InvalidRidError
from ringserve.requests import chat_request, generate_requests
from ringserve.results import ChatResult, GenerateDelta, GenerateResult

log = logging.getLogger("ringserve")
CONTROL_TIMEOUT = 10.0
UPDATE_TIMEOUT = 600.0  # loading a checkpoint and waiting for the requests on the old weights


class Client(RingSession):
    """An async connection to one ring (one namespace on one NATS); use `async with Client(...) as client`."""

    # --- generation ---------------------------------------------------------------------------------------

    async def generate(self, prompt: str | Sequence[str] | None = None,
                       sampling_params: dict[str, Any] | Sequence[dict[str, Any]] | None = None, *,
                       input_ids: list[int] | list[list[int]] | None = None, rid: str | Sequence[str] | None = None,
                       return_logprob: bool | None = None, top_logprobs_num: int | None = None,
                       logprob_start_len: int | None = None, timeout: float | None = None,
                       on_result: Callable[[int, GenerateResult], None] | None = None, image_data: Any = None,
                       mm_processor_kwargs: dict[str, Any] | None = None) -> GenerateResult | list[GenerateResult]:
        """Generate for one prompt (a result) or a list (results in prompt order), as `/generate` does.
        `image_data`: the prompts' images, as `/generate` takes them (`ringserve.requests.image_source`);
        `mm_processor_kwargs`: their image processor's options (Gemma 3's `do_pan_and_scan`, ...).

        `on_result(i, result)` is called as each request of a list finishes (a progress bar). Raises ApiError:
        the first failing request's error (the others are aborted), or a 504 after `timeout` seconds.
        """
        requests, listed = generate_requests(prompt, sampling_params, input_ids, rid, image_data, mm_processor_kwargs,
                                             return_logprob=return_logprob, top_logprobs_num=top_logprobs_num,
                                             logprob_start_len=logprob_start_len)
        await self.store_images(requests, listed)
        results = await self.run_all(requests, timeout, on_result)
        return results if listed else results[0]

    def stream(self, prompt: str | Sequence[str] | None = None,
               sampling_params: dict[str, Any] | Sequence[dict[str, Any]] | None = None, *,
               input_ids: list[int] | list[list[int]] | None = None, rid: str | Sequence[str] | None = None,
               return_logprob: bool | None = None, top_logprobs_num: int | None = None,
               logprob_start_len: int | None = None, image_data: Any = None,
               mm_processor_kwargs: dict[str, Any] | None = None) -> AsyncIterator[GenerateDelta]:
        """The deltas of one prompt (or of a list, each with its `index`) as they arrive; closing the iterator
        early aborts the requests. An error output raises its ApiError."""
        requests, listed = generate_requests(prompt, sampling_params, input_ids, rid, image_data, mm_processor_kwargs,
                                             return_logprob=return_logprob, top_logprobs_num=top_logprobs_num,
                                             logprob_start_len=logprob_start_len)
        return self._stream_with_images(requests, listed)

    async def chat(self, messages: list[dict[str, Any]], sampling_params: dict[str, Any] | None = None, *,
                   rid: str | None = None, timeout: float | None = None,
                   chat_template_kwargs: dict[str, Any] | None = None, **openai_fields: Any) -> ChatResult:
        """A chat completion, as `/v1/chat/completions` answers it (`response`), with the chat template, tools
        (`tools`, `tool_choice`), structured output (`response_format`) and OpenAI's names (`max_tokens`,
        `temperature`, `reasoning_effort`, ...); `sampling_params` adds native parameters (`thinking_token_budget`,
        ...); `chat_template_kwargs` are the template's extra variables (Qwen3's `enable_thinking`). A reasoning
        model's thinking is the result's `reasoning_text`, apart from the answer's `text`."""
        from ringserve.actors.entry.openai.bodies import full_response

        request, options = chat_request(messages, rid, await self._model_name(), sampling_params, openai_fields,
                                        chat_template_kwargs)
        await self.store_images([request])
        outputs = await self._with_timeout(self._collect_outputs(request), timeout, [request.rid])
        response = full_response(request.rid, options, [outputs])
        message = response["choices"][0]["message"]
        base = GenerateResult.from_outputs(request.rid, outputs, request.sampling)
        return ChatResult(text=message.get("content") or "", output_ids=base.output_ids, meta_info=base.meta_info,
                          reasoning_text=base.reasoning_text, message=message, response=response)

    def chat_stream(self, messages: list[dict[str, Any]], sampling_params: dict[str, Any] | None = None, *,
                    rid: str | None = None, model: str = "", chat_template_kwargs: dict[str, Any] | None = None,
                    **openai_fields: Any) -> AsyncIterator[GenerateDelta]:
        """The text deltas of a chat completion as they arrive (tool calls are not parsed out of them); a reasoning
        model's new thinking is each delta's `reasoning_text`, apart from its answer `text`."""
        request, _ = chat_request(messages, rid, model, sampling_params, openai_fields, chat_template_kwargs)
        return self._stream_with_images([request])

    async def store_images(self, requests: list[GenerateRequest], batch: bool = False) -> None:
        """Put the images of `requests` (chat image_url parts, `image_data`) into the ring's image store, so the
        requests carry their handles (actors/entry/image_input.py; local files anywhere, no http(s) URLs). A NATS
        client puts them into its own bucket (bus/image_store.py `client_bucket_name`), created on first use with
        the limits its credentials file notes (`image_ttl`, `image_store_max_bytes`: the server's)."""
        from ringserve.actors.entry.image_input import ImageIntake, ImageLimits
        from ringserve.bus import image_store

        if not any(r.image_data or any(t.parts for t in r.messages or []) for r in requests):
            return
        intake = getattr(self, "_image_intake", None)
        if intake is None:
            bus = self.ring.bus
            store = image_store.ImageStore(
                lambda: bus.client, self.subjects.namespace,
                float(self.notes.get("image_ttl", image_store.DEFAULT_TTL_SECONDS)),
                int(self.notes.get("image_store_max_bytes", image_store.DEFAULT_MAX_BYTES)), client=self.client)
            intake = self._image_intake = ImageIntake(store, ImageLimits(local_dir="/"))
        await intake.resolve_all(requests, batch)

    async def _stream_with_images(self, requests: list[GenerateRequest],
                                  batch: bool = False) -> AsyncIterator[GenerateDelta]:
        await self.store_images(requests, batch)
        async with contextlib.aclosing(self.stream_requests(requests)) as deltas:
            async for delta in deltas:
                yield delta

    async def embed(self, input: str | Sequence[str] | list[int] | list[list[int]], *, pooling: str | None = None,
                    normalize: bool = True, dimensions: int | None = None,
                    timeout: float | None = None) -> list[float] | list[list[float]]:
        """The served model's embedding of one input (a string or token ids: one vector) or of a list of them
        (vectors in order), as `/v1/embeddings` computes it (`pooling` last or mean, default the server's;
        `normalize`: unit length; `dimensions`: the first d components). Raises ApiError as the route would."""
        from ringserve.actors.entry.openai.embeddings import parse_embeddings, shaped
        from ringserve.bus.subjects import new_rid

        body = {"input": input, "pooling": pooling, "normalize": normalize, "dimensions": dimensions}
        requests, _, dimensions = parse_embeddings(body, new_rid(), "")
        outputs = await self._with_timeout(self._gather([self._collect_outputs(r) for r in requests]), timeout,
                                           [r.rid for r in requests])
        vectors = [shaped(out[-1], dimensions, normalize).tolist() for out in outputs]
        single = isinstance(input, str) or all(isinstance(t, int) for t in input)
        return vectors[0] if single else vectors

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
