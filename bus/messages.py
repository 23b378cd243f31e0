"""Typed wire messages of the request ring, narrowest-first.

`GenerateRequest -> TokenizedRequest -> BatchTokenOutput -> RequestOutput`: each hop drops what the next
actor does not need. Every message is a dataclass encoded by `ringserve.bus.codec`. README.md documents the schema for
clients that speak NATS directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ringserve.bus.errors import ApiError
from ringserve.bus.images import ImageRef
from ringserve.bus.params import DecodeParams, EmbedParams, SamplingParams
from ringserve.bus.reasoning import ReasoningPlan


@dataclass
class ChatMessage:
    """One chat turn, its content flattened to text.

    An assistant turn may hold `tool_calls`, each OpenAI's `{"id", "type": "function", "function": {"name",
    "arguments"}}` with `arguments` a JSON text; a `role: "tool"` turn answers the call `tool_call_id`.
    """

    role: str
    content: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None  # the author's name (OpenAI's optional `name`)
    # an assistant turn's thinking, as a client sent it back (chat's `reasoning_content`, an Anthropic thinking
    # block): given to templates that render it (Qwen3's keeps the thinking of the turns after the last user turn)
    reasoning_content: str | None = None
    # a turn with images: its content in order, {"type": "text", "text"} or {"type": "image", "handle"} (the image
    # file's object store key, bus/image_store.py); `content` is then its text parts joined
    parts: list[dict[str, str]] | None = None


@dataclass
class GenerateRequest:
    """A client's request, as submitted on `{ns}.req.submit` (HTTP entry or any NATS client).

    Exactly one of `text`, `messages` (chat template applied) or `input_ids` is set. `sampling` holds the
    raw parameters as the client sent them, under SGLang's names (declared in `ringserve.bus.params.SamplingParams`);
    the tokenizer validates them. With `messages`, `add_generation_prompt` opens the assistant's turn after
    them, and `continue_final_message` instead continues the last message (the assistant's) where its text
    ends; at most one of the two may be true. `tools` (messages only) are the function tools the model may
    call, as OpenAI's `{"type": "function", "function": {"name", "description", "parameters"}}`: the tokenizer
    renders them through the chat template (or its default tool prompt); enforcing and parsing calls is the
    sender's part (the HTTP entry's). `stream=False` says the sender reads only the whole output: the
    outputs are the same deltas, but fewer (the first token at once, then up to 64 tokens each), which costs
    the ring less.
    Subscribe to `{ns}.out.{rid}` before publishing, or the first outputs may be missed.
    """

    rid: str
    text: str | None = None
    messages: list[ChatMessage] | None = None
    input_ids: list[int] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True  # messages only: end the prompt with the assistant's turn header
    continue_final_message: bool = False  # messages only: continue the last (assistant) message, no new turn
    openai_names: bool = False  # errors name parameters as OpenAI bodies do (max_tokens), not natively
    tools: list[dict[str, Any]] | None = None  # messages only: function tools to render in the prompt
    stream: bool = True  # False: the sender reads only the whole output (fewer, larger outputs)
    # an embedding request: prefill only (sampling's max_new_tokens must be 0), its pooled vector in the output
    embed: EmbedParams | None = None
    # `text`'s images, in the order of its image placeholders: their files' object store keys (bus/image_store.py)
    image_data: list[str] | None = None
    # options for the model's image processor, raw as sent (bus/params.py `ImageProcessing`; the tokenizer checks)
    mm_processor_kwargs: dict[str, Any] | None = None
    # messages only: extra variables for the chat template (vLLM's `chat_template_kwargs`, e.g. Qwen3's
    # `enable_thinking`), over the server's `--default-chat-template-kwargs`; unknown keys reach the template too
    chat_template_kwargs: dict[str, Any] | None = None


@dataclass
class TokenizedRequest:
    """A validated, tokenized request on `{ns}.req.tokenized`, ready for the scheduler. `detokenizer`: the id of
    the detokenizer its rows go to (`{ns}.tokens.{detokenizer}`), chosen by the tokenizer among the live ones."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    detokenizer: int = 0
    stream: bool = True  # the sender's GenerateRequest.stream
    embed: EmbedParams | None = None  # the sender's GenerateRequest.embed
    images: list[ImageRef] = field(default_factory=list)  # its images, in prompt order (bus/images.py)
    # the router's hint: replica `kv_peer` holds the prompt's first `kv_peer_blocks` blocks (-1: none known)
    kv_peer: int = -1
    kv_peer_blocks: int = 0
    kv_prefill: int = -1  # prefill/decode split: the prefill replica to compute the prompt's KV (-1: none)
    reasoning: ReasoningPlan | None = None  # the output opens with thinking (bus/reasoning.py); None: it does not


@dataclass
class FinishReason:
    """Why a request ended. `type` is "stop", "length", "abort" or "error"; `matched` is the stop string or
    token id; an "error" finish carries its `error`, which the detokenizer puts in `RequestOutput.error`."""

    type: str
    matched: int | str | None = None
    error: ApiError | None = None


@dataclass
class TokenRow:
    """One request's new tokens in one scheduler step.

    `logprobs[i]` is the logprob of `token_ids[i]`; `top_ids[i]`/`top_logprobs[i]` its most likely
    alternatives (empty unless the request asked for logprobs). With `return_prompt_ids` or `logprob_start_len`
    the request's first row carries its prompt (`prompt_ids`); with `logprob_start_len`, the logprobs of the
    prompt's last `len(prompt_logprobs)` tokens (None for the prompt's first token, which nothing predicts),
    their 1-based ranks in the vocabulary (0 there) and alternatives.
    """

    rid: str
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    finish: FinishReason | None = None
    decode: DecodeParams | None = None  # set on the request's first row only, for the detokenizer
    # speculative decoding, so far: draft tokens verified for the request, and accepted
    spec_drafted_tokens: int = 0
    spec_accepted_tokens: int = 0
    queue_time: float | None = None  # first row only: seconds the request waited in the scheduler's queue
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[float | None] = field(default_factory=list)
    prompt_ranks: list[int] = field(default_factory=list)
    prompt_top_ids: list[list[int]] = field(default_factory=list)
    prompt_top_logprobs: list[list[float]] = field(default_factory=list)
    # first row only, with tracing on: the request's trace context, so the detokenizer's span joins its trace
    traceparent: str | None = None
    embedding: bytes = b""  # an embedding request's last row: its vector, little-endian float32


@dataclass
class BatchTokenOutput:
    """Everything one scheduler step produced for one detokenizer shard: one message per step, not per token.

    `replica`, `epoch` (the replica's incarnation) and `seq` (1, 2, ... per incarnation and detokenizer; 0:
    unnumbered) let the detokenizer see that a message was lost (a gap) or that a replica was restarted (a new
    epoch): the evidence, never elapsed time, by which it gives up on a request whose last rows may be gone.
    """

    step: int
    rows: list[TokenRow]
    replica: int = -1
    epoch: str = ""
    seq: int = 0


@dataclass
class TopLogprob:
    """One candidate token and its logprob. `bytes` are the token's raw bytes (a byte-level token's text is
    U+FFFD when it holds part of a character; its bytes are exact), None when the sender did not know them."""

    token_id: int
    token: str
    logprob: float
    bytes: list[int] | None = None


@dataclass
class TokenLogprob:
    """A token's logprob and, if asked for, the most likely alternatives at its position.
    `bytes` as in TopLogprob: the token's raw bytes, which reassemble a character split over tokens. A prompt
    token also has its 1-based `rank` in the vocabulary; the prompt's first token has neither logprob nor rank."""

    token_id: int
    token: str
    logprob: float | None
    top: list[TopLogprob] = field(default_factory=list)
    bytes: list[int] | None = None
    rank: int | None = None


@dataclass
class RequestOutput:
    """A delta of one request's output on `{ns}.out.{rid}`.

    `text`, `token_ids` and `logprobs` are new since the previous message (never repeated, never a partial
    UTF-8 character, never part of a trimmed stop string). The last message has `finish` or `error` set.
    `seq` numbers a request's outputs 0, 1, 2, ...: a reader that sees a gap knows an output was lost.
    """

    rid: str
    seq: int = 0
    text: str = ""  # the answer; with a reasoning plan, the thinking is in `reasoning_text` instead
    reasoning_text: str = ""  # new thinking text (bus/reasoning.py), its start and end markers left out
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    spec_drafted_tokens: int = 0  # speculative decoding, so far: draft tokens verified, and accepted
    spec_accepted_tokens: int = 0
    finish: FinishReason | None = None
    error: ApiError | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    queue_time: float | None = None  # first output only: seconds the request waited in the scheduler's queue
    # first output only: with logprob_start_len, the prompt's tokens from there on with their logprobs; with
    # return_prompt_ids (or logprob_start_len), the prompt's token ids
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    embedding: bytes = b""  # an embedding request's last output: its vector, little-endian float32

    @property
    def is_last(self) -> bool:
        return self.finish is not None or self.error is not None


@dataclass
class AbortRequest:
    """Stop a request and free its KV at once; published on `{ns}.abort.{rid}`."""

    rid: str
    reason: str = "client"


@dataclass
class InfoQuery:
    """Request body for control queries such as `{ns}.control.scheduler.info`."""

    detail: bool = False


@dataclass
class SchedulerInfo:
    """Scheduler load as reported on `{ns}.control.scheduler.info`.

    KV tokens: `kv_running_tokens` are held by running requests (their own plus shared cached prefixes they
    use), `kv_cached_tokens` are held only by the prefix cache (evictable); the rest of `kv_total_tokens` is free.
    """

    rank: int
    num_running_reqs: int
    num_waiting_reqs: int
    kv_used_tokens: int
    kv_total_tokens: int
    context_length: int
    step: int
    model: str
    kv_running_tokens: int = 0
    kv_cached_tokens: int = 0
    cache_hit_rate: float = 0.0  # cached / total prompt tokens of admitted requests since start
    num_retractions: int = 0
    paused: bool = False
    radix_cache: bool = True
    chunked_prefill_size: int = 0
    overlap_schedule: bool = False  # the engine plans step N+1 before applying step N
    stream_interval: int = 1  # tokens per published row of a request (--stream-interval)
    # torch threads each decode step size runs on, as the scheduler measured them (empty: fixed or not yet known)
    torch_threads: dict[str, int] = field(default_factory=dict)
    # --quantization int8/int4: the method, the ISA, and per linear shape and row count the kernel measured
    # fastest at start-up (empty: float32)
    quantization: dict[str, str] = field(default_factory=dict)
    lora_adapters: list[str] = field(default_factory=list)  # LoRA adapters served (--lora-modules, loaded at run time)
    # how the KV pool size was chosen: "tokens", "sized_from" ("--max-total-tokens", "0.1 of host MemTotal", ...)
    kv_pool: dict[str, str] = field(default_factory=dict)
    # decode graphs: "mode" (cuda_graph, compile, eager or off), "max_bs", and in compile mode what runs each
    # requested batch size ("compiled (1.60x, 41 s)", "eager (compiled 0.95x)", "compiling", "queued")
    decode_graphs: dict[str, str] = field(default_factory=dict)
    # the execution choices resolved once at start (actors/engine/execution_plan.py): "attention_backend",
    # "norm_rotary_kernels", "fused_cpu_decode" (and "fused_cpu_decode_layers"), "moe_path", "graph_mode",
    # "graph_max_bs", "row_invariant"
    execution: dict[str, str] = field(default_factory=dict)
    # requests this replica was handed since it started (routed to it, or through the fallback queue group)
    requests_routed: int = 0
    tp_size: int = 1  # tensor-parallel ranks of this replica (one report per replica, from its rank 0)
    # which weights serve: "1" for those loaded at start, then each update_weights_from_disk's (or the next number)
    weight_version: str = ""
    # speculative decoding since start: the algorithm, draft tokens proposed and accepted, tokens verify rows
    # emitted (accepted drafts plus one each) and verify rows run
    speculative: str = "none"
    spec_drafted_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_emitted_tokens: int = 0
    spec_verify_rows: int = 0
    # the KV tier (--kv-tier-bytes): blocks and bytes it holds; since start, blocks saved to it, blocks loaded
    # from it (and their bytes and seconds), blocks dropped for a bad checksum
    kv_tier_blocks: int = 0
    kv_tier_bytes: int = 0
    kv_tier_saved_blocks: int = 0
    kv_tier_loaded_blocks: int = 0
    kv_tier_loaded_bytes: int = 0
    kv_tier_load_seconds: float = 0.0
    kv_tier_corrupt_blocks: int = 0
    kv_fetched_blocks: int = 0  # --kv-share: blocks fetched from other replicas (and their bytes, seconds)
    kv_fetched_bytes: int = 0
    kv_fetch_seconds: float = 0.0
    kv_fetch_failures: int = 0  # fetches that stopped short (deadline, holder gone, bad checksum)
    kv_served_blocks: int = 0  # blocks this replica sent to others


@dataclass
class ControlCommand:
    """An operator command on `{ns}.control.scheduler.command` (request/reply, answered by `ControlReply`).

    `action`: "flush_cache" (drop every cached prefix no running request uses), "abort_all", "pause"
    (stop stepping; running requests keep their KV, new ones queue), "continue", or "update_weights_from_disk":
    load the checkpoint at `model_path` (same architecture), swap it in and flush the prefix cache. Its `mode`
    says what happens to the requests the engine holds: "wait" (they finish on the old weights; new ones wait
    for the swap), "pause" (they pause, and resume on the new weights, their KV recomputed) or "abort" (they
    are aborted). `weight_version` names the new weights (default: the next number).
    """

    action: str
    model_path: str | None = None
    mode: str = "wait"
    weight_version: str | None = None
    lora_name: str | None = None  # "load_lora_adapter" (from `lora_path`) and "unload_lora_adapter"
    lora_path: str | None = None


@dataclass
class ControlReply:
    """The scheduler's answer to a ControlCommand; a command refused for its arguments carries the `error` (a 400,
    or a 409 while another weight update runs), which the HTTP route answers with."""

    ok: bool
    message: str = ""
    detail: dict[str, int | str] = field(default_factory=dict)
    error: ApiError | None = None


MISSED_BEATS = 3  # an actor silent for this many of its heartbeat intervals counts as gone (routing, placement)


@dataclass
class Heartbeat:
    """Every actor's sign of life, on `{ns}.control.heartbeat` every `interval` seconds.

    `live_rids` counts the requests the actor holds per-request state for (0 when none is left behind). A
    scheduler replica also sends its `load` (its replica id is `load.replica`). `draining`: the actor is
    stopping (SIGINT/SIGTERM): it finishes what it holds and must be given nothing new. Beats come from a thread
    of their own (actors/common/heartbeat.py), so a busy actor still beats; `loop_lag` says how many seconds old
    the numbers are (how long the actor's event loop has been busy: shown, never a reason to end a request).
    """

    role: str
    rank: int
    pid: int
    interval: float
    live_rids: int = 0
    load: ReplicaLoad | None = None
    draining: bool = False
    loop_lag: float = 0.0
    # the actor's own counters since it started (a tokenizer's image cache), shown in /get_server_info's actors
    counters: dict[str, int] = field(default_factory=dict)


@dataclass
class ActorGone:
    """The launcher saw an actor's process end, on `{ns}.control.gone`: the entry ends the streams it held at
    once instead of waiting out its heartbeat silence. `pid` names the process, so a restarted actor (a new pid)
    is not taken for the one that ended."""

    role: str
    rank: int
    pid: int
    cause: str = ""


@dataclass
class Accepted:
    """Reply to a submission sent as a NATS request: the next actor has taken the request.

    The entry submits with request/reply, so a ring with no tokenizer or scheduler answers at once
    ("no responders") or not at all (a timeout) instead of leaving the client waiting for outputs forever.
    `replica`: the scheduler replica that took it, `detokenizer`: the detokenizer its rows go to (None when
    unknown: a bad request ends at the tokenizer). The entry ends a request whose replica or detokenizer dies.
    """

    rid: str
    replica: int | None = None
    detokenizer: int | None = None


@dataclass
class ActorReady:
    """An actor announces it is serving, on `{ns}.control.ready`."""

    role: str
    rank: int
    pid: int
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class ReplicaLoad:
    """A scheduler replica's load, in its heartbeat (`Heartbeat.load`): what the tokenizers route by and what
    `/get_server_info`'s `replicas` shows. `draining`: it finishes what it holds and takes nothing new.
    `kv_epoch`, `kv_seq`: the incarnation and the sequence number of its last `KvEvents` (bus/kv_messages.py), so a
    router that missed the last events of a quiet replica notices (and resyncs from a `KvSnapshot`)."""

    replica: int
    interval: float
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_used_tokens: int = 0
    kv_total_tokens: int = 0
    cache_hit_rate: float = 0.0
    tp_size: int = 1
    draining: bool = False
    kv_epoch: str = ""
    kv_seq: int = 0
    role: str = "both"  # prefill, decode or both (--replica-role): a prefill replica takes no routed requests
