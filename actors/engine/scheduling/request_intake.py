"""Taking a request into the engine (`EngineCore.add_request`): checked (request_checks.py, its images, its
adapter, its embedding), made a `Req` with everything its steps read, and queued: for prefill, or first for its
grammar's compilation."""

from __future__ import annotations

import random
from typing import Any, MutableMapping

import torch

from ringserve.actors.engine.core.embedding import embed_state
from ringserve.actors.engine.core.reasoning_gate import reasoning_gate
from ringserve.actors.engine.core.request import Req
from ringserve.actors.engine.lora.serving import LoraServing
from ringserve.actors.engine.models.causal_lm import CausalLM
from ringserve.actors.engine.scheduling.grammar import GrammarManager
from ringserve.actors.engine.scheduling.images import request_images
from ringserve.actors.engine.scheduling.prefill import PrefillManager
from ringserve.actors.engine.scheduling.request_checks import request_error
from ringserve.bus.errors import ApiError
from ringserve.bus.images import image_key
from ringserve.bus.messages import TokenizedRequest
from ringserve.kernels.sampling import PenaltyState


class RequestIntake:
    """Checks new requests against the model and the pool, and queues those that can run."""

    def __init__(self, model: CausalLM, context_length: int, num_slots: int, has_tokenizer: bool,
                 embedding_pooling: str, device: torch.device, adapters: LoraServing, grammars: GrammarManager,
                 prefill: PrefillManager, live: MutableMapping[str, Req]) -> None:
        """`context_length`: the longest sequence served (`--context-length`, at most the model's); `has_tokenizer`:
        stop strings can be checked; `embedding_pooling`: an embedding request's default
        (`--embedding-pooling`); `live`: the engine's live requests by rid, which a queued request joins."""
        self.model, self.num_slots, self.has_tokenizer = model, num_slots, has_tokenizer
        self.vocab_size: int = model.vocab_size
        self.context_length = context_length
        self.rope_rule = model.rope_length_rule
        self.embedding_pooling, self.device = embedding_pooling, device
        self.adapters, self.grammars, self.prefill, self.live = adapters, grammars, prefill, live

    def add(self, request: TokenizedRequest, images: dict[str, dict[str, Any]] | None = None) -> ApiError | None:
        """Queue `request`, or say why it cannot run (with the numbers involved). `images[ref.hash]`: the processed
        tensors of each of `request.images` (as the model's processor returns them for that one image)."""
        rejection = request_error(request, self.live, self.vocab_size, self.context_length, self.num_slots,
                                  self.has_tokenizer)
        if rejection is not None:
            return rejection
        checked = request_images(self.model, list(request.input_ids), request.images, images)
        if isinstance(checked, ApiError):
            return checked
        params = request.sampling
        error = self.adapters.request_error(params.lora_name)
        if error is not None:
            return error
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        req = Req(request.rid, len(request.input_ids), list(request.input_ids), params, seed)
        if request.reasoning is not None:
            req.reasoning = request.reasoning
            constrained = params.grammar is not None
            req.gate = reasoning_gate(request.reasoning, constrained, self.grammars.spacing() if constrained else None)
        req.lora_cache_name = self.adapters.cache_name(params.lora_name)
        if self.rope_rule is not None:
            req.rope_floor, req.rope_cache_name = req.prompt_len, self.rope_rule.cache_name(req.prompt_len)
        if checked:
            req.images, req.image_key = checked, image_key(req.ids, request.images)
            req.rope_shift = checked[-1].rope_shift
        if request.embed is not None:
            state = embed_state(request.embed, self.embedding_pooling, params.max_new_tokens)
            if isinstance(state, ApiError):
                return state
            req.embed = state
        if params.uses_penalties:
            req.penalties = PenaltyState(request.input_ids, self.vocab_size, self.device)
        if params.grammar is not None:  # waits outside the queues until its grammar is compiled
            error = self.grammars.submit(req)
            if error is not None:
                return error
        else:
            self.prefill.add(req)
        self.live[req.rid] = req
        return None
