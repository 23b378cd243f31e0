"""The engine the scheduler actor drives: request intake, continuous batching, and one forward per `step`.

Single-threaded by contract: `add_request` and `abort` are called only between steps. Each step decodes one
token for every running request and, in the same forward, prefills the waiting requests that the batch
policy admits. Finished, aborted and preempted requests give their KV slots back at once.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from actors.common.model_source import ModelSource
from actors.engine.batch_policy import BatchPolicy
from actors.engine.llama import LlamaForCausalLM
from actors.engine.model_runner import ModelRunner
from actors.engine.request import Request
from actors.engine.stop_checker import StopChecker
from bus.messages import ErrorInfo, FinishReason, TokenizedRequest, TokenRow

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class EngineConfig:
    """Capacity and placement of the engine."""

    max_total_tokens: int = 32768  # KV pool size in token slots
    max_prefill_tokens: int = 8192  # prefill tokens admitted per step
    max_running_requests: int = 256
    dtype: str = "float32"  # one of DTYPES; used when loading weights (an in-memory model keeps its own)
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("max_total_tokens", "max_prefill_tokens", "max_running_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass
class EngineStats:
    """Load snapshot for the scheduler's info and metrics."""

    num_running_reqs: int
    num_waiting_reqs: int
    kv_used_tokens: int
    kv_total_tokens: int
    context_length: int
    num_preemptions: int  # since start


class Engine:
    """Continuous-batching inference over our Llama with a paged KV cache."""

    def __init__(self, model: LlamaForCausalLM, config: EngineConfig, tokenizer: Any | None = None) -> None:
        """`model` already on `config.device`; `tokenizer` is needed only by requests with stop strings."""
        self.config = config
        self.device = torch.device(config.device)
        self.vocab_size: int = model.config.vocab_size
        self.context_length: int = model.config.max_position_embeddings
        self.tokenizer = tokenizer
        self.runner = ModelRunner(
            model,
            num_slots=config.max_total_tokens,
            max_requests=config.max_running_requests,
            max_len=min(self.context_length, config.max_total_tokens),
            device=self.device,
        )
        self.policy = BatchPolicy(config.max_prefill_tokens, config.max_running_requests)
        self.stop_checker = StopChecker(tokenizer, self.context_length)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.live: dict[str, Request] = {}
        self.num_preemptions = 0

    @classmethod
    def from_source(cls, source: ModelSource, config: EngineConfig, tokenizer: Any | None = None) -> Engine:
        """Load the model at `source` (GGUF or safetensors) and build an engine; loads the tokenizer if not given."""
        from actors.common.model_source import load_tokenizer
        from actors.engine.weights import load_model

        model = load_model(source, config.torch_dtype, config.device)
        return cls(model, config, tokenizer if tokenizer is not None else load_tokenizer(source))

    def add_request(self, req: TokenizedRequest) -> ErrorInfo | None:
        """Queue `req`, or say why it cannot run (an ErrorInfo with the numbers involved)."""
        error = self._validate(req)
        if error is not None:
            return error
        generator = None
        if req.sampling.temperature > 0:
            generator = torch.Generator(device=self.device)
            if req.sampling.seed is None:
                generator.seed()
            else:
                generator.manual_seed(req.sampling.seed)
        request = Request(req.rid, list(req.input_ids), req.sampling, generator)
        self.live[req.rid] = request
        self.waiting.append(request)
        return None

    def _validate(self, req: TokenizedRequest) -> ErrorInfo | None:
        ids, sampling = req.input_ids, req.sampling
        if req.rid in self.live:
            return ErrorInfo(f"request id {req.rid!r} is already in use by a live request", param="rid")
        if not ids:
            return ErrorInfo("the prompt is empty", param="input_ids")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            return ErrorInfo(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", param="input_ids")
        if sampling.max_new_tokens < 1:
            return ErrorInfo(
                f"max_new_tokens must be at least 1, got {sampling.max_new_tokens}", param="max_new_tokens"
            )
        total = len(ids) + sampling.max_new_tokens
        for limit, what in ((self.context_length, "the context length"), (self.config.max_total_tokens, "the KV pool")):
            if total > limit:
                return ErrorInfo(
                    f"{len(ids)} prompt tokens + {sampling.max_new_tokens} max_new_tokens = {total} exceeds "
                    f"{what} ({limit} tokens)",
                    param="max_new_tokens",
                )
        if any(not s for s in sampling.stop):
            return ErrorInfo("stop strings must not be empty", param="stop")
        if sampling.stop and self.tokenizer is None:
            return ErrorInfo("stop strings need a tokenizer, and this engine has none", type="server_error", code=500)
        return None

    def abort(self, rid: str) -> TokenRow | None:
        """Drop a waiting or running request now and free its KV; its final row, or None if `rid` is not live."""
        req = self.live.get(rid)
        if req is None:
            return None
        if req in self.running:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self._release(req)
        return self._row(req, [], FinishReason("abort"))

    def has_work(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self.waiting or self.running)

    def step(self) -> list[TokenRow]:
        """Run one forward over the running requests plus newly admitted prefills; one row per request in it."""
        for _ in range(self.policy.preemptions(self.running, self.runner.kv_cache.num_free)):
            self._preempt(self.running[-1])
        admitted = self.policy.admissions(self.waiting, len(self.running), self.runner.kv_cache.num_free)
        for _ in range(admitted):
            req = self.waiting.popleft()
            req.row = self.runner.kv_cache.assign_row()
            self.running.append(req)
        if not self.running:
            return []
        batch = list(self.running)
        tokens = self.runner.step(batch)
        rows = []
        for req, token in zip(batch, tokens):
            req.output_ids.append(token)
            finish = self.stop_checker.check(req)
            if finish is not None:
                self.running.remove(req)
                self._release(req)
            rows.append(self._row(req, [token], finish))
        return rows

    def stats(self) -> EngineStats:
        """Current load: request counts and KV slot usage."""
        kv = self.runner.kv_cache
        return EngineStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_used_tokens=kv.num_used,
            kv_total_tokens=kv.num_slots,
            context_length=self.context_length,
            num_preemptions=self.num_preemptions,
        )

    def _preempt(self, req: Request) -> None:
        """Recompute-style preemption: free the KV, keep the output, requeue at the front."""
        self.running.remove(req)
        self._free_kv(req)
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def _free_kv(self, req: Request) -> None:
        if req.row is not None:
            self.runner.kv_cache.release(req.row, req.num_cached)
            req.row = None
        req.num_cached = 0

    def _release(self, req: Request) -> None:
        self._free_kv(req)
        del self.live[req.rid]

    def _row(self, req: Request, token_ids: list[int], finish: FinishReason | None) -> TokenRow:
        row = TokenRow(
            rid=req.rid,
            token_ids=token_ids,
            prompt_tokens=len(req.prompt_ids),
            completion_tokens=len(req.output_ids),
            finish=finish,
            sampling=None if req.first_row_sent else req.sampling,
        )
        req.first_row_sent = True
        return row
