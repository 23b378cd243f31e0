"""`ringserve.Engine`: the ring from Python, for offline batches and scripts, as SGLang's `Engine`.

`Engine(model=...)` starts the ring as `ringserve serve` does, with the launcher's own code
(`actors/launcher/ring.py`): an embedded nats-server with per-role users, then the scheduler, tokenizer and
detokenizer processes (no HTTP entry unless `http=True`), each its own process. The Engine itself is the
entry: it connects to the ring as the entry role through a `ringserve.Client` on a private event-loop
thread, so its requests take the path HTTP requests take (tokenizer, scheduler with continuous batching and
the prefix cache, detokenizer). `Engine(nats_url=..., namespace=...)` instead connects to a ring that runs
already. Every method is blocking and thread-safe; the `async_*` ones are awaitable from any event loop.

If an actor dies, the launcher's fail-stop applies: the running calls fail with a 503 ApiError and the ring
is stopped. `shutdown()` (also at interpreter exit, on leaving a `with` block, or after Ctrl-C in a call)
aborts what runs, stops every actor and the nats-server, and deletes the generated credentials.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import time
import weakref
from pathlib import Path
from typing import Any, Sequence

from ringserve.bus.errors import server_error
from ringserve._bridge import AsyncStream, LoopThread, SyncStream, run_on
from ringserve.client import Client
from ringserve.results import ChatResult, GenerateDelta, GenerateResult

log = logging.getLogger("ringserve")
PROGRESS_MIN_PROMPTS = 64  # lists at least this long show a progress bar on a terminal (progress=None)


class Engine:
    """A ring started (or joined) from Python; see the module docstring."""

    def __init__(self, model: str | None = None, *, nats_url: str | None = None, namespace: str | None = None,
                 creds: str | Path | None = None, http: bool = False, log_level: str = "WARNING",
                 startup_timeout: float = 600.0, max_in_flight: int | None = None, progress: bool | None = None,
                 **engine_flags: Any) -> None:
        """`model`: what `ringserve serve --model` takes (default: the packaged SmolLM2-135M-Instruct).
        `engine_flags`: any other `ringserve serve` flag by its Python name (`max_running_requests=64`,
        `chunked_prefill_size=256`, `disable_radix_cache=True`, `tokenizer_workers=2`, ...); `http=True` also
        starts the HTTP entry (`port=`, `host=`; `http_url` says where). `nats_url`: join a running ring instead
        (with `namespace` and, on a NATS with auth, `creds`: the entry role's or a client's credentials file).
        `log_level`: the actors' log level. `max_in_flight`: requests of a list submitted at once. `progress`:
        False shows no progress bar (neither the actors' weight loading nor `generate`'s), True shows
        `generate`'s for every list, None (the default) for lists of 64 prompts or more on a terminal."""
        self._progress = progress
        self._thread = LoopThread("ringserve-engine")
        self._ring: Any = None
        self._supervisor: Any = None
        self._watcher: Any = None
        self._client: Client | None = None
        self._closed = False
        self._failure: str | None = None
        self.http_url: str | None = None
        try:
            if nats_url is not None:
                if model is not None or engine_flags or http:
                    raise TypeError("with nats_url the Engine joins a running ring: model, http and engine flags "
                                    "belong to the ring's `ringserve serve`")
                self._client = Client(nats_url, namespace, creds, max_in_flight=max_in_flight,
                                      name="ringserve-engine")
                self._thread.run(self._client.connect())
            else:
                flags = {"log_level": log_level, "startup_timeout": startup_timeout, **engine_flags}
                if model is not None:
                    flags["model"] = model
                if namespace is not None:
                    flags["namespace"] = namespace
                self._thread.run(self._start(flags, http, max_in_flight))
        except BaseException:
            self.shutdown()
            raise
        atexit.register(_shutdown_at_exit, weakref.ref(self))

    async def _start(self, flags: dict[str, Any], http: bool, max_in_flight: int | None) -> None:
        """Plan the ring, start nats-server and the actors from this (the loop's) thread, connect as the entry."""
        from ringserve.actors.launcher.ring import Ring
        from ringserve.actors.launcher.serve_flags import serve_args
        from ringserve.bus.embedded_server import free_port

        if http and "port" not in flags:
            flags["port"] = free_port()
        args = serve_args(flags)
        self._ring = ring = Ring(args, http=http)  # raises RingError (a ValueError) for flags that cannot run
        started = time.monotonic()
        print(f"ringserve: starting the ring for {ring.served_name} (scheduler, tokenizer, detokenizer"
              f"{', entry' if http else ''})...", file=sys.stderr, flush=True)
        ring.start_nats()  # children of this thread: the kernel stops them if the process dies (die_with_parent)
        self._supervisor = ring.supervisor()
        with _no_progress_bars() if self._progress is False else contextlib.nullcontext():
            code = await self._supervisor.start(args.startup_timeout)
        if code is not None:
            raise RuntimeError(f"the ring did not start (an actor died or was not ready within "
                               f"{args.startup_timeout:g}s; see its log above)")
        self._watcher = self._thread.loop.create_task(self._watch())
        self._client = Client(ring.url, ring.subjects.namespace, credentials=ring.credentials("entry"),
                              max_in_flight=max_in_flight, served_model=ring.served_name, name="ringserve-engine")
        await self._client.connect()
        seen = await self._client.ring.wait_for_replicas(args.dp, args.startup_timeout)
        if seen < args.dp:
            raise RuntimeError(f"only {seen} of {args.dp} scheduler replicas beat within {args.startup_timeout:g}s")
        if http:
            self.http_url = f"http://{args.host}:{args.port}"
        print(f"ringserve: ready in {time.monotonic() - started:.1f}s", file=sys.stderr, flush=True)

    async def _watch(self) -> None:
        """Fail-stop: when an actor dies or stalls, fail every running call and stop the ring."""
        code = await self._supervisor.watch()
        if code != 0 and not self._closed:
            self._failure = "an actor of the ring died or stalled (see its log above); the ring was stopped"
            if self._client is not None:
                await self._client.fail_all(server_error(self._failure, 503))
            await self._supervisor.close()

    # --- generation ---------------------------------------------------------------------------------------

    def generate(self, prompt: str | Sequence[str] | None = None,
                 sampling_params: dict[str, Any] | Sequence[dict[str, Any]] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, *, stream: bool = False,
                 rid: str | Sequence[str] | None = None, return_logprob: bool | None = None,
                 top_logprobs_num: int | None = None, logprob_start_len: int | None = None,
                 timeout: float | None = None, progress: bool | None = None, image_data: Any = None,
                 mm_processor_kwargs: dict[str, Any] | None = None,
                 ) -> GenerateResult | list[GenerateResult] | SyncStream[GenerateDelta]:
        """Generate for one prompt (text or `input_ids`; a GenerateResult) or a list of them (a list of results,
        in order), with `/generate`'s native `sampling_params` (one dict, or one per prompt; `max_new_tokens`
        defaults to 128). `stream=True`: an iterator of GenerateDeltas instead (each with its prompt's
        `index`). `progress`: a progress bar for a list (default: the Engine's `progress`, else on a terminal
        from 64 prompts). `image_data`: the prompts' images for a vision-language model, as `/generate` takes them
        (one image or a list; a list per prompt for a list), each file bytes, a PIL image, a `pathlib.Path`, base64
        or a data URL; the text holds the model's image placeholder where each goes. `mm_processor_kwargs`: the
        image processor's options, as `/generate` takes them (Gemma 3's `do_pan_and_scan`, ...).
        Raises ApiError as the HTTP API would."""
        kwargs = dict(rid=rid, return_logprob=return_logprob, top_logprobs_num=top_logprobs_num,
                      logprob_start_len=logprob_start_len, image_data=image_data,
                      mm_processor_kwargs=mm_processor_kwargs)
        client = self._live_client()
        if stream:
            return SyncStream(self._thread, client.stream(prompt, sampling_params, input_ids=input_ids, **kwargs))
        bar = self._progress_bar(prompt if prompt is not None else input_ids,
                                 self._progress if progress is None else progress)
        try:
            return self._thread.run(client.generate(prompt, sampling_params, input_ids=input_ids, timeout=timeout,
                                                    on_result=(lambda i, r: bar.update(1)) if bar else None,
                                                    **kwargs))
        finally:
            if bar is not None:
                bar.close()

    def async_generate(self, prompt: str | Sequence[str] | None = None,
                       sampling_params: dict[str, Any] | Sequence[dict[str, Any]] | None = None,
                       input_ids: list[int] | list[list[int]] | None = None, *, stream: bool = False,
                       rid: str | Sequence[str] | None = None, return_logprob: bool | None = None,
                       top_logprobs_num: int | None = None, logprob_start_len: int | None = None,
                       timeout: float | None = None, image_data: Any = None,
                       mm_processor_kwargs: dict[str, Any] | None = None) -> Any:
        """`generate` for async code (any event loop): an awaitable of the result(s), or with `stream=True` an
        async iterator of GenerateDeltas (also awaitable, giving itself). Cancelling aborts the requests."""
        kwargs = dict(rid=rid, return_logprob=return_logprob, top_logprobs_num=top_logprobs_num,
                      logprob_start_len=logprob_start_len, image_data=image_data,
                      mm_processor_kwargs=mm_processor_kwargs)
        client = self._live_client()
        if stream:
            return AsyncStream(self._thread, client.stream(prompt, sampling_params, input_ids=input_ids, **kwargs))
        return run_on(self._thread, client.generate(prompt, sampling_params, input_ids=input_ids, timeout=timeout,
                                                    **kwargs))

    def chat(self, messages: list[dict[str, Any]], sampling_params: dict[str, Any] | None = None, *,
             stream: bool = False, rid: str | None = None, timeout: float | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             **openai_fields: Any) -> ChatResult | SyncStream[GenerateDelta]:
        """A chat completion with the model's chat template, taking what `/v1/chat/completions` takes besides
        `messages` (`max_tokens`, `temperature`, `tools`, `tool_choice`, `response_format`, `reasoning_effort`, ...;
        `image_url` content parts for a vision-language model: data URLs or file URLs) and native
        `sampling_params` (`thinking_token_budget`, ...); `chat_template_kwargs`: the template's extra variables
        (`{"enable_thinking": False}` turns Qwen3's thinking off). A ChatResult (`text`: the answer,
        `reasoning_text`: a reasoning model's thinking, `message` with any `tool_calls`, `response`: the OpenAI
        body). `stream=True`: an iterator of deltas (`text`, and `reasoning_text` for the thinking)."""
        client = self._live_client()
        if stream:
            return SyncStream(self._thread, client.chat_stream(messages, sampling_params, rid=rid,
                                                               model=client.served_model or "",
                                                               chat_template_kwargs=chat_template_kwargs,
                                                               **openai_fields))
        return self._thread.run(client.chat(messages, sampling_params, rid=rid, timeout=timeout,
                                            chat_template_kwargs=chat_template_kwargs, **openai_fields))

    def async_chat(self, messages: list[dict[str, Any]], sampling_params: dict[str, Any] | None = None, *,
                   rid: str | None = None, timeout: float | None = None,
                   chat_template_kwargs: dict[str, Any] | None = None, **openai_fields: Any) -> Any:
        """`chat` for async code: an awaitable of the ChatResult."""
        client = self._live_client()
        return run_on(self._thread, client.chat(messages, sampling_params, rid=rid, timeout=timeout,
                                                chat_template_kwargs=chat_template_kwargs, **openai_fields))

    def embed(self, input: str | Sequence[str] | list[int] | list[list[int]], *, pooling: str | None = None,
              normalize: bool = True, dimensions: int | None = None,
              timeout: float | None = None) -> list[float] | list[list[float]]:
        """The served model's embedding of one input (text or token ids: a vector) or of a list (vectors in
        order), as `/v1/embeddings` computes it: `pooling` last or mean (default: the server's
        --embedding-pooling), `normalize` to unit length, `dimensions` the first d components."""
        return self._thread.run(self._live_client().embed(input, pooling=pooling, normalize=normalize,
                                                          dimensions=dimensions, timeout=timeout))

    # --- control ------------------------------------------------------------------------------------------

    def abort(self, rid: str) -> None:
        """Stop request `rid` now (its call returns with finish reason "abort")."""
        self._thread.run(self._live_client().abort(rid))

    def flush_cache(self) -> dict[str, Any]:
        """Drop every cached prefix no running request uses; `{"success", "message", "freed_tokens"}`."""
        return self._thread.run(self._live_client().flush_cache())

    def pause_generation(self) -> dict[str, Any]:
        """Stop stepping (running requests keep their KV; new ones queue) until `continue_generation`."""
        return self._thread.run(self._live_client().pause_generation())

    def continue_generation(self) -> dict[str, Any]:
        """Step again after `pause_generation`."""
        return self._thread.run(self._live_client().continue_generation())

    def get_server_info(self) -> dict[str, Any]:
        """The scheduler's load and settings (`num_running_reqs`, `kv_used_tokens`, `weight_version`, ...)."""
        return self._thread.run(self._live_client().get_server_info())

    def update_weights_from_disk(self, model_path: str | Path, mode: str = "wait",
                                 weight_version: str | None = None) -> dict[str, Any]:
        """Swap in the checkpoint at `model_path` (same architecture) without a restart: `mode` "wait" lets
        running requests finish first, "pause" pauses them and resumes them on the new weights, "abort" aborts
        them; the prefix cache is flushed. Raises ApiError 400 (the old weights keep serving) for a checkpoint
        that does not fit. Returns `weight_version`, `model_path` and the counts."""
        return self._thread.run(self._live_client().update_weights_from_disk(str(model_path), mode, weight_version))

    # --- lifetime -----------------------------------------------------------------------------------------

    @property
    def nats_url(self) -> str:
        return self._live_client().url

    @property
    def namespace(self) -> str:
        return self._live_client().subjects.namespace

    def pids(self) -> dict[str, int]:
        """The ring's processes started by this Engine (`scheduler0`, ..., `nats-server`) -> their pids."""
        pids = dict(self._supervisor.pids()) if self._supervisor is not None else {}
        nats = getattr(self._ring, "nats", None)
        if nats is not None and nats.process is not None:
            pids["nats-server"] = nats.process.pid
        return pids

    def shutdown(self) -> None:
        """Abort what still runs, stop the actors and nats-server, delete the credentials; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._thread.running:
                self._thread.run(self._close(), timeout=120)
        finally:
            self._thread.stop()
            if self._ring is not None:
                self._ring.close()  # the nats-server last; also when the loop could not run the rest

    async def _close(self) -> None:
        if self._client is not None:
            await self._client.close()
        if self._supervisor is not None:
            self._supervisor.stop()
            if self._watcher is not None:
                await self._watcher
            await self._supervisor.close()
        if self._ring is not None:
            self._ring.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _live_client(self) -> Client:
        if self._closed or self._client is None:
            raise RuntimeError("the Engine is shut down")
        if self._failure is not None:
            raise server_error(self._failure, 503)
        return self._client

    @staticmethod
    def _progress_bar(prompts: Any, progress: bool | None) -> Any:
        count = len(prompts) if isinstance(prompts, list) and prompts and not isinstance(prompts[0], int) else 1
        if progress is None:
            progress = count >= PROGRESS_MIN_PROMPTS and sys.stderr.isatty()
        if not progress or count < 2:
            return None
        from tqdm import tqdm

        return tqdm(total=count, desc="Generating", unit="req")


@contextlib.contextmanager
def _no_progress_bars() -> Any:
    """While the actors start, their environment turns tqdm off (`TQDM_DISABLE`): the launcher's code copies
    this process's environment into each actor's."""
    before = os.environ.get("TQDM_DISABLE")
    os.environ["TQDM_DISABLE"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = before


def _shutdown_at_exit(ref: "weakref.ref[Engine]") -> None:
    engine = ref()
    if engine is not None:
        engine.shutdown()
