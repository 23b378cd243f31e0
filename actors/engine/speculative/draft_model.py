"""Drafts from a smaller model with the target's tokenizer (`--speculative-algorithm draft
--speculative-draft-model-path PATH`), run as an engine of its own in the scheduler's process.

Each verify step asks the draft engine for every speculating request's next `k` tokens: one greedy request per
target request, its prompt the target's tokens so far. The draft engine's prefix cache still holds the request's
earlier tokens (its previous draft request's prompt and drafts), so only what was accepted since is prefilled,
then `k - 1` decode steps run, all the step's requests batched together. Rejected drafts stay in the draft's
cache as any finished request's tokens do, and age out with them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from ringserve.actors.engine.config import EngineConfig
from ringserve.actors.engine.core.request import Req
from ringserve.actors.engine.interface import EngineInterface
from ringserve.bus.messages import TokenizedRequest
from ringserve.bus.params import SamplingParams


class DraftEngine(EngineInterface, Protocol):
    """The draft model's engine: an engine like the served model's (an `EngineCore`), and the tokenizer it has."""

    tokenizer: Any


class DraftEngineLoader(Protocol):
    """What builds the draft model's engine (the `EngineCore` class): from a model source, with a config."""

    def from_source(self, source: Any, config: EngineConfig, tokenizer: Any | None = None) -> DraftEngine:
        """Load the model at `source` and build its engine."""


class DraftModel:
    """Greedy drafts from `engine` (the draft model's, without speculation of its own)."""

    def __init__(self, engine: EngineInterface) -> None:
        self.engine = engine
        self._requests = 0

    def draft(self, wanted: dict[Req, int]) -> dict[Req, list[int]]:
        """Up to `wanted[req]` greedy draft tokens after each request's tokens."""
        asked: dict[str, Req] = {}
        for req, k in wanted.items():
            self._requests += 1
            rid = f"{req.rid}#draft{self._requests}"
            request = TokenizedRequest(rid, list(req.ids), SamplingParams(
                max_new_tokens=k, temperature=0.0, ignore_eos=True, cache_salt=req.params.cache_salt))
            if self.engine.add_request(request) is None:  # refused (longer than the draft's context): no draft
                asked[rid] = req
        out: dict[Req, list[int]] = {req: [] for req in asked.values()}
        while self.engine.has_work():
            for row in self.engine.step():
                if row.rid in asked:
                    out[asked[row.rid]] += row.token_ids
        return {req: tokens for req, tokens in out.items() if tokens}


def load_draft_engine(engine_class: DraftEngineLoader, config: EngineConfig, tokenizer: Any) -> DraftEngine:
    """The draft model's engine for `config` (`--speculative-draft-model-path`): its own pool and prefix cache,
    the served model's device and threads, its own GGUF blocks where the served model runs a GGUF's; ValueError
    when its tokenizer is not the served model's (`tokenizer`)."""
    from ringserve.actors.common.model_source import resolve_model

    source = resolve_model(config.speculative_draft_model_path)
    quantization = "none" if config.quantization == "gguf" and source.gguf_file is None else config.quantization
    draft = engine_class.from_source(source, dataclasses.replace(
        config, quantization=quantization, speculative_algorithm="none", speculative_draft_model_path="",
        overlap_schedule="off", enable_lora=False, lora_modules="", lora_dir="",  # adapters fit the target only
        kv_tier_bytes=0, kv_tier_dir="",  # the tier (one bound, one directory) is the served model's alone
        kv_tier_write_through=False))
    check_same_tokenizer(tokenizer, draft.tokenizer, config.speculative_draft_model_path)
    return draft


def check_same_tokenizer(target: Any, draft: Any, draft_path: str) -> None:
    """ValueError unless the draft model's tokenizer maps every token as the target's does."""
    if target is None or draft is None:
        return
    if target.get_vocab() != draft.get_vocab():
        raise ValueError(f"--speculative-draft-model-path {draft_path}: its tokenizer is not the served model's "
                         f"({len(draft.get_vocab())} tokens against {len(target.get_vocab())}, or other ids); a "
                         "draft model must share the tokenizer")
