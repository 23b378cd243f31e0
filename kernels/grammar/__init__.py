"""Constrained decoding: one small interface for grammar backends (xgrammar by default).

A `GrammarSpec` names a constraint (`json_object`, `json_schema`, `regex`, `ebnf`, or `structural_tag`: xgrammar's
structural tag, e.g. free text until a trigger string, then a tag whose content is constrained) and is the cache key.
One `GrammarCompiler` per engine (per tokenizer) checks and compiles specs into `CompiledGrammar`s, cached by
spec and LRU-bounded, synchronously or on a small thread pool so that compilation stays off the step path; the
xgrammar backend parses and compiles in worker processes bounded in memory and time (`compile_pool`). A server
warms a compiler before its first request: `warm_up` compiles a tiny grammar, `start_workers` starts every worker.
Each constrained request owns a `GrammarMatcher`: per step it fills its row of a packed int32 bitmask
(`torch_bitmask`, xgrammar's layout), `apply_bitmask` masks the constrained rows of the batch's logits in one
vectorised pass, and the sampled token is fed back with `accept_token`.

The interface is in spec.py (what a constraint is) and backend.py (what a backend implements), re-exported here
beside `make_compiler`. Importing this package is light (torch only); the xgrammar backend is imported by
`make_compiler`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ringserve.kernels.grammar.backend import CompiledGrammar, GrammarCompiler, GrammarMatcher, fill_bitmasks
from ringserve.kernels.grammar.spec import KINDS, GrammarError, GrammarKind, GrammarSpec, UnreachableTag
from ringserve.kernels.grammar.torch_bitmask import allocate_bitmask, apply_bitmask, bitmask_width, unpack_bitmask

__all__ = [
    "KINDS", "CompiledGrammar", "GrammarCompiler", "GrammarError", "GrammarMatcher", "GrammarSpec", "UnreachableTag",
    "allocate_bitmask", "apply_bitmask", "bitmask_width", "fill_bitmasks", "make_compiler", "prepare_vocabulary",
    "unpack_bitmask",
]


def make_compiler(tokenizer: Any, vocab_size: int | None = None, *, backend: str = "xgrammar",
                  **options: Any) -> GrammarCompiler:
    """A compiler for a Hugging Face `tokenizer` and the model's `vocab_size` (the logits' width).

    `options` go to the backend (xgrammar: `prepared`, what `prepare_vocabulary` made of this tokenizer before,
    in which case `tokenizer` may be None; `stop_token_ids`, `any_whitespace`, `cache_size`, `compile_threads`,
    `max_threads`, and the compile workers' `memory_bytes` and `time_limit`).
    """
    if backend != "xgrammar":
        raise ValueError(f"unknown grammar backend {backend!r}; available: xgrammar")
    from ringserve.kernels.grammar.xgrammar_backend import XGrammarCompiler

    return XGrammarCompiler(tokenizer, vocab_size, **options)


def prepare_vocabulary(tokenizer: Any, vocab_size: int | None = None, *, backend: str = "xgrammar",
                       stop_token_ids: Sequence[int] | None = None) -> dict[str, Any]:
    """What a compiler derives from a Hugging Face `tokenizer` (xgrammar: its tokenizer info, seconds for a
    large vocabulary), as plain JSON data to keep and hand to `make_compiler(None, vocab_size, prepared=...)`."""
    if backend != "xgrammar":
        raise ValueError(f"unknown grammar backend {backend!r}; available: xgrammar")
    from ringserve.kernels.grammar.xgrammar_backend import prepare_vocabulary as prepare

    return prepare(tokenizer, vocab_size, stop_token_ids)
