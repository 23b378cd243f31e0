"""Tokenizer actor: `{ns}.req.submit` and `{ns}.client.*.submit` -> validate + tokenize -> `{ns}.req.tokenized`,
errors to the request's output subject; and `{ns}.tokenizer.tokenize` (request/reply) -> the entry's
`/v1/tokenize` and `/v1/detokenize`, encoded by the same PromptEncoder as generation.

Several tokenizer processes may serve one deployment: they share the submit subject through a queue group.
With several scheduler replicas (`--dp`), each request goes to the one `router.py` picks from the replicas'
heartbeats (`{ns}.req.tokenized.{replica}`); before any heartbeat, or when the picked replica does not take
it, to any replica through the queue group on `{ns}.req.tokenized`. The router knows what each replica's prefix
cache holds from the replica's KV events (`{ns}.kv.events.{r}`), resynced from `{ns}.kv.snapshot.{r}` after a
gap. Each request is also stamped with the detokenizer its rows go to, chosen among the live detokenizers
(`actors/detokenizer/placement.py`).

The chat flags (chat_options.py) shape each request here: `--chat-template` replaces the model's template,
`--default-chat-template-kwargs` and the request's `chat_template_kwargs` reach it (prompt.py), the model's
generation_config.json fills the sampling parameters a request leaves out (generation_defaults.py), and a chat
request of a reasoning model gets its `ReasoningPlan` (reasoning.py). A `TokenizeQuery` with `model_info`
answers the defaults in force and the reasoning parser (the entry's `/get_model_info`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from ringserve.actors.common.model_source import UnservableModel, resolve_model
from ringserve.actors.common.text_tokenizer import load_text_model
from ringserve.actors.common.runtime import ActorContext, exit_now
from ringserve.actors.detokenizer.placement import DetokenizerPlacement
from ringserve.actors.engine.config import served_context_length
from ringserve.actors.tokenizer.chat_options import ChatOptions
from ringserve.actors.tokenizer.generation_defaults import generation_defaults
from ringserve.actors.tokenizer.images import VisionPrompts, image_handles, images_param, is_vision_model
from ringserve.actors.tokenizer.prompt import PromptEncoder
from ringserve.actors.tokenizer.reasoning import ReasoningPlanner
from ringserve.actors.tokenizer.router import Router
from ringserve.actors.tokenizer.grammar_check import GrammarChecker
from ringserve.actors.tokenizer.validation import prompt_param, validate_sampling
from ringserve.bus.params import PROCESSOR_KWARGS, SPECS, processor_kwargs
from ringserve.bus.codec import DecodeError, encode, peek_field
from ringserve.bus.connection import Delivery
from ringserve.bus.errors import ApiError, server_error
from ringserve.bus.image_store import ImageStore
from ringserve.bus.images import ImageRef, image_key
from ringserve.bus.kv_blocks import cache_namespace
from ringserve.bus.kv_messages import KvEvents, KvSnapshot
from ringserve.bus.messages import Accepted, GenerateRequest, Heartbeat, InfoQuery, RequestOutput, TokenizedRequest
from ringserve.bus.permissions import reply_inbox
from ringserve.bus.subjects import TOKENIZER_QUEUE, InvalidRidError, scoped_rid, split_rid, validate_rid
from ringserve.bus.tokenize_messages import TokenizeQuery, TokenizeReply
from ringserve.observability import tracing
from ringserve.observability.logging import log_event

log = logging.getLogger("tokenizer")
SCHEDULER_ACCEPT_TIMEOUT = 10.0
KV_SNAPSHOT_TIMEOUT = 2.0


class TokenizerActor:
    """Owns the prompt encoder and the validation rules; keeps no per-request state."""

    def __init__(self, ctx: ActorContext, model: str, detokenizers: int = 1,
                 options: ChatOptions | None = None, context_length: int | None = None) -> None:
        """`detokenizers`: how many the launcher starts (ids 0..n-1), chosen among until one has beat;
        `options`: the chat flags (default: all at their defaults); `context_length`: `--context-length`, the
        longest sequence served (None: the model's own)."""
        self._ctx = ctx
        options = options or ChatOptions()
        source = resolve_model(model)
        text_model = load_text_model(source)
        self._tokenizer = text_model.tokenizer
        if options.chat_template is not None:
            self._tokenizer.chat_template = options.chat_template
        self._encoder = PromptEncoder(text_model.tokenizer, options.default_chat_template_kwargs)
        self._reasoning = ReasoningPlanner(text_model.tokenizer, options.reasoning_parser, options.budget)
        try:
            self._defaults = generation_defaults(source, options.generation_config)
        except ValueError as exc:
            raise UnservableModel(str(exc)) from None
        if self._defaults:
            log_event(log, logging.INFO, "sampling defaults from generation_config.json", **self._defaults)
        try:
            self._context_length = served_context_length(text_model.context_length, context_length)
        except ValueError as exc:
            raise UnservableModel(str(exc)) from None
        self._eos_ids = text_model.eos_token_ids
        self._grammars = GrammarChecker(text_model.tokenizer, text_model.vocab_size)
        self._router = Router()
        self._resyncs: dict[int, asyncio.Task[None]] = {}  # a KV snapshot being fetched for the router, per replica
        self._detokenizers = DetokenizerPlacement(range(detokenizers))
        # a vision-language model's processor (images.py); None: the model takes no images
        self._vision = VisionPrompts(source, ImageStore(lambda: ctx.bus.client, ctx.subjects.namespace)) \
            if is_vision_model(source) else None

    @property
    def grammar_checker(self) -> GrammarChecker:
        """The checker of requests' output constraints (`tokenizer_main` warms it with --grammar-warm-up)."""
        return self._grammars

    async def start(self) -> dict[str, Any]:
        namespace = self._ctx.subjects.namespace
        self._intake = [  # unsubscribed when draining; the requests being handed over finish (`live_rids`)
            await self._ctx.bus.subscribe(self._ctx.subjects.submit, GenerateRequest, self._on_submit,
                                          queue=TOKENIZER_QUEUE, on_malformed=self._on_malformed),
            await self._ctx.bus.subscribe(self._ctx.subjects.client_submit_any, GenerateRequest, self._on_submit,
                                          queue=TOKENIZER_QUEUE, on_malformed=self._on_malformed,
                                          reply_inbox=lambda subject: reply_inbox(namespace, subject)),
            await self._ctx.bus.subscribe(self._ctx.subjects.tokenize, TokenizeQuery, self._on_tokenize,
                                          queue=TOKENIZER_QUEUE, on_malformed=self._on_malformed_query)]
        self._handing_over = 0  # submissions being tokenized and handed to a scheduler
        self._ctx.live_rids = lambda: self._handing_over
        if self._vision is not None:
            self._ctx.counters = self._vision.counters
        self._ctx.on_drain.append(self._stop_intake)
        await self._ctx.bus.subscribe(self._ctx.subjects.heartbeat, Heartbeat, self._on_heartbeat)
        await self._ctx.bus.subscribe(self._ctx.subjects.kv_events_any, KvEvents, self._on_kv_events)
        return {"context_length": self._context_length, "eos_token_ids": self._eos_ids,
                "reasoning_parser": self._reasoning.name, "default_sampling_params": self._defaults}

    async def _stop_intake(self) -> None:
        for sub in self._intake:
            await sub.unsubscribe()

    async def _on_heartbeat(self, beat: Heartbeat, delivery: Delivery) -> None:
        if beat.role == "scheduler" and beat.load is not None:
            if self._router.on_heartbeat(beat.load, time.monotonic()):
                self._resync(beat.load.replica)
        self._detokenizers.on_heartbeat(beat, time.monotonic())

    async def _on_kv_events(self, events: KvEvents, delivery: Delivery) -> None:
        if self._router.on_kv_events(events):
            self._resync(events.replica)

    def _resync(self, replica: int) -> None:
        """Fetch replica `replica`'s KV snapshot for the router (once at a time), again while it leaves a gap."""
        if replica not in self._resyncs:
            self._resyncs[replica] = asyncio.get_running_loop().create_task(self._fetch_snapshot(replica))

    async def _fetch_snapshot(self, replica: int) -> None:
        try:
            again = True
            while again:
                snapshot = await self._ctx.bus.request(self._ctx.subjects.kv_snapshot(replica), InfoQuery(),
                                                       KvSnapshot, KV_SNAPSHOT_TIMEOUT)
                again = self._router.on_kv_snapshot(snapshot)
        except Exception as exc:  # gone, stalled, or a bad reply: its next heartbeat or gap asks again
            self._router.snapshot_failed(replica)
            log_event(log, logging.INFO, "no KV snapshot from a replica", replica=replica, error=repr(exc)[:200])
        finally:
            del self._resyncs[replica]

    async def _on_malformed(self, data: bytes, error: DecodeError, delivery: Delivery) -> Accepted | None:
        """A submission that does not decode ends at once with a 400 on its output subject, if it names a rid."""
        rid = peek_field(data, "rid")
        if not isinstance(rid, str):
            return None
        req = GenerateRequest(rid=rid)
        if not self._own_rid(req, delivery):
            return None
        where = str(error).split(":", 1)[0].removeprefix("GenerateRequest.")
        return await self._answer(req, delivery, ApiError(f"malformed request: {error}"[:1000], param=where[:100]))

    async def _on_submit(self, req: GenerateRequest, delivery: Delivery) -> Accepted | None:
        """Validate, tokenize and hand over to a scheduler; errors go to the request's output subject."""
        if not self._own_rid(req, delivery):
            return None
        self._handing_over += 1
        try:
            handed = await self._forward(req, delivery.traceparent)
        finally:
            self._handing_over -= 1
        if isinstance(handed, Accepted):
            # the entry learns which replica and which detokenizer hold it
            return Accepted(rid=req.rid, replica=handed.replica, detokenizer=handed.detokenizer)
        return await self._answer(req, delivery, handed)

    async def _on_tokenize(self, query: TokenizeQuery, delivery: Delivery) -> TokenizeReply:
        """Answer a tokenize or detokenize query; a rejected one is answered with its error."""
        try:
            reply = await self._tokenize(query)
        except ApiError as exc:
            reply = TokenizeReply(error=exc)
        except Exception as exc:  # a bug must still answer, or the entry waits for its timeout
            log.exception("tokenize query failed")
            reply = TokenizeReply(error=server_error(f"tokenizing failed: {exc!r}"[:1000]))
        reply.max_model_len = self._context_length
        if len(encode(reply)) + 1024 > self._ctx.bus.max_payload:
            reply = TokenizeReply(max_model_len=self._context_length, error=ApiError(
                "the answer exceeds the bus payload limit", 413, param="tokens" if query.token_ids else "prompt"))
        return reply

    async def _on_malformed_query(self, data: bytes, error: DecodeError, delivery: Delivery) -> TokenizeReply:
        where = str(error).split(":", 1)[0].removeprefix("TokenizeQuery.")
        return TokenizeReply(max_model_len=self._context_length,
                             error=ApiError(f"malformed tokenize query: {error}"[:1000], param=where[:100]))

    async def _tokenize(self, query: TokenizeQuery) -> TokenizeReply:
        if query.model_info:
            return TokenizeReply(default_sampling_params=dict(self._defaults), reasoning_parser=self._reasoning.name)
        given = [name for name in ("text", "messages", "token_ids") if getattr(query, name) is not None]
        if len(given) != 1:
            raise ApiError("give exactly one of prompt, messages or tokens", param="prompt")
        if query.token_ids is not None:
            vocab = self._encoder.vocab_size
            for i, t in enumerate(query.token_ids):
                if not 0 <= t < vocab:
                    raise ApiError(f"tokens[{i}] = {t} is not a token id in [0, {vocab})", param="tokens")
            return TokenizeReply(text=self._tokenizer.decode(query.token_ids, skip_special_tokens=False))
        if query.messages is not None:
            if query.add_special_tokens:  # the chat template holds the special tokens; generation adds none
                raise ApiError("add_special_tokens is not supported with messages: the chat template adds them",
                               param="add_special_tokens")
            req = GenerateRequest(rid="tokenize", messages=query.messages, tools=query.tools,
                                  add_generation_prompt=query.add_generation_prompt,
                                  continue_final_message=query.continue_final_message,
                                  chat_template_kwargs=query.chat_template_kwargs)
            if image_handles(req):  # as a generation would see them: each image's tokens expanded
                return TokenizeReply(tokens=(await self._encode_images(req))[0])
            return TokenizeReply(tokens=self._encoder.encode(req))
        assert query.text is not None
        add_special = True if query.add_special_tokens is None else query.add_special_tokens
        return TokenizeReply(tokens=list(self._tokenizer.encode(query.text, add_special_tokens=add_special)))

    async def _encode_images(self, req: GenerateRequest, options: dict[str, Any] | None = None,
                             client: str | None = None) -> tuple[list[int], list[ImageRef], str | None]:
        """Token ids and image refs of a prompt with images (images.py), `options` for the image processor, its
        files read from NATS client `client`'s bucket (None: the shared one), and the rendered chat prompt (None
        for a text prompt); a 400 if the model takes none."""
        if self._vision is None:
            raise ApiError("this model takes no images: serve a vision-language model to send them",
                           param=images_param(req))
        chat = self._encoder.chat_text(req) if req.messages is not None else None
        return (*await self._vision.encode(req, chat, options, client), chat)

    def _processor_options(self, req: GenerateRequest) -> dict[str, Any]:
        """`req.mm_processor_kwargs` checked: declared (bus/params.py), and taken by the model's image processor
        (a text model has none)."""
        options = processor_kwargs(req.mm_processor_kwargs)
        if options and self._vision is None:
            raise ApiError(f"{PROCESSOR_KWARGS}: this model takes no images, so it has no image processor",
                           param=PROCESSOR_KWARGS)
        if options and self._vision is not None:
            self._vision.check_options(options)
        return options

    def _own_rid(self, req: GenerateRequest, delivery: Delivery) -> bool:
        """Check `req.rid`; a submission on `{ns}.client.{c}.submit` is client c's, so its rid becomes the scoped
        `c~rid` and its outputs go to `{ns}.client.{c}.out.{rid}` (bus/subjects.py), which only c may read."""
        try:
            validate_rid(req.rid)
            if delivery.subject != self._ctx.subjects.submit:
                req.rid = scoped_rid(self._ctx.subjects.client_of(delivery.subject), req.rid)
        except InvalidRidError as exc:
            log_event(log, logging.WARNING, "dropped request with invalid rid", error=str(exc)[:300])
            return False
        return True

    async def _answer(self, req: GenerateRequest, delivery: Delivery, error: ApiError | None) -> Accepted:
        """Publish `error` (if any) as the request's only output, and accept the submission either way."""
        if error is not None:
            await self._ctx.bus.publish(self._ctx.subjects.output(req.rid), RequestOutput(rid=req.rid, error=error),
                                        delivery.traceparent)
        return Accepted(rid=req.rid)

    async def tokenize_request(self, req: GenerateRequest) -> TokenizedRequest:
        """`req` validated and tokenized, with its reasoning plan, for no scheduler replica yet (`detokenizer`
        unset); ApiError for a request the client must change."""
        images, options = image_handles(req), self._processor_options(req)
        client = split_rid(req.rid)[0]  # a client's images are in its own bucket
        if images:
            input_ids, refs, chat = await self._encode_images(req, options, client)
        else:
            (input_ids, chat), refs = self._encoder.encode_prompt(req), []
        if req.embed is not None and len(input_ids) > self._context_length:
            raise ApiError(f"the input is {len(input_ids)} tokens; this model embeds at most "
                           f"{self._context_length}", param="input")
        keep = SPECS["truncate_prompt_tokens"].read(req.sampling, None)
        if keep is not None and refs:
            raise ApiError("truncate_prompt_tokens cannot cut a prompt with images", param="truncate_prompt_tokens")
        if keep is not None:  # the side is checked again with the rest of the sampling parameters
            right = SPECS["truncation_side"].read(req.sampling, "left") == "right"
            input_ids = input_ids[:keep] if right else input_ids[-keep:]
        sampling = validate_sampling(req.sampling, len(input_ids), self._context_length, self._encoder.vocab_size,
                                     self._eos_ids, req.openai_names, self._defaults, prompt_param(req))
        reasoning = self._reasoning.plan(chat, sampling, req.sampling, req.openai_names) \
            if req.embed is None else None
        await self._grammars.check(sampling, req.openai_names, req.rid)
        return TokenizedRequest(rid=req.rid, input_ids=input_ids, sampling=sampling, stream=req.stream,
                                embed=req.embed, images=refs, reasoning=reasoning)

    async def _forward(self, req: GenerateRequest, traceparent: str) -> ApiError | Accepted:
        """Validate and tokenize `req` and hand it to a scheduler replica: the replica's `Accepted`, or why not."""
        with tracing.span("tokenize", attributes={"ringserve.rid": req.rid}) as span:
            try:
                tokenized = await self.tokenize_request(req)
            except ApiError as exc:
                tracing.set_error(span, f"invalid request: {exc}")
                return exc
            except Exception as exc:  # a bug here must end this request now, not leave it waiting
                log.exception("tokenizing %s failed", req.rid)
                tracing.set_error(span, f"tokenizing failed: {exc!r}")
                return server_error(f"tokenizing the request failed: {exc!r}"[:1000])
            if span is not None:
                span.set_attribute("gen_ai.usage.input_tokens", len(tokenized.input_ids))
        tokenized.detokenizer = self._detokenizers.choose(req.rid, time.monotonic())
        salt = cache_namespace(tokenized.sampling.cache_salt, tokenized.sampling.lora_name)
        key_ids = image_key(tokenized.input_ids, tokenized.images) if tokenized.images \
            else tokenized.input_ids  # as the cache keys it
        replica = self._router.route(key_ids, time.monotonic(), salt)
        if replica is not None:  # another replica holding more of the prompt: the chosen one may fetch it
            tokenized.kv_peer, tokenized.kv_peer_blocks = self._router.holder(key_ids, replica, time.monotonic(),
                                                                              salt)
            if tokenized.kv_peer < 0:  # a decode replica (--replica-role): a prefill replica computes the prompt
                tokenized.kv_prefill = self._router.prefill_for(replica, time.monotonic())
        subject = self._ctx.subjects.tokenized if replica is None else self._ctx.subjects.tokenized_for(replica)
        try:
            try:
                return await self._ctx.bus.request(subject, tokenized, Accepted, SCHEDULER_ACCEPT_TIMEOUT,
                                                   traceparent)
            except asyncio.TimeoutError:
                if replica is None:
                    raise
                # the routed replica is gone (no responders) or stuck: stop routing to it, let any replica take it
                self._router.forget(replica)
                log_event(log, logging.WARNING, "routed replica did not take a request; any replica may",
                          replica=replica, rid=req.rid)
                return await self._ctx.bus.request(self._ctx.subjects.tokenized, tokenized, Accepted,
                                                   SCHEDULER_ACCEPT_TIMEOUT, traceparent)
        except asyncio.TimeoutError as exc:
            return server_error(f"no scheduler accepted the request: {exc}", 503)
        except Exception as exc:  # e.g. the tokenized request exceeds the bus payload limit
            log.exception("handing %s to a scheduler failed", req.rid)
            return server_error(f"handing the request to a scheduler failed: {exc!r}"[:1000], 503)


async def tokenizer_main(ctx: ActorContext, model: str, detokenizers: int = 1, options: ChatOptions | None = None,
                         grammar_warm_up: bool = True, context_length: int | None = None) -> dict[str, Any]:
    """Entry point for the runtime: build the actor and subscribe. A model it cannot serve ends the process at
    once with one error line (exit code 1), before it reports ready. `grammar_warm_up` (--grammar-warm-up):
    warm the grammar checker from the start and report ready once it is warm (grammar_check.py);
    `context_length`: --context-length (None: the model's own)."""
    if grammar_warm_up:
        from ringserve.kernels.grammar.compile_pool import prestart

        prestart()  # the checker's worker process imports torch and xgrammar while the tokenizer loads
    try:
        actor = TokenizerActor(ctx, model, detokenizers, options, context_length)
    except (UnservableModel, FileNotFoundError) as exc:
        log_event(log, logging.ERROR, "cannot serve this model", model=model, reason=str(exc))
        exit_now(1)
        raise  # not reached: exit_now ended the process
    if not grammar_warm_up:
        return await actor.start()
    checker = actor.grammar_checker
    checker.warm_up()
    detail = await actor.start()
    detail["grammars"] = await asyncio.to_thread(checker.wait_warm)
    return detail
