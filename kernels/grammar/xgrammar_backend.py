"""The xgrammar grammar backend: TokenizerInfo from a Hugging Face tokenizer, compiler, per-request matchers.

- `json_object` is xgrammar's JSON-schema grammar for `{"type": "object"}` (any object, nested values any JSON),
  as vLLM does: xgrammar's builtin JSON grammar also accepts a top-level array.
- `json_schema` uses xgrammar's strict mode (properties and items the schema does not list are refused unless
  it says otherwise), whatever the request's OpenAI `strict` flag says.
- JSON is compact by default (`any_whitespace=False`: `{"a": 1, "b": [2]}`): fixed keys become forced text for
  jump-forward, and a small model cannot loop on whitespace. `regex` and `ebnf` (GBNF/xgrammar EBNF with a
  `root` rule) are compiled as given.
- The tokenizer's special tokens other than the stop tokens are blanked in the vocabulary xgrammar sees, so
  no mask ever allows them (xgrammar would otherwise read `<|im_start|>` as literal text inside a string).
- A client's grammar is never parsed or compiled in this process. xgrammar has no memory limit of its own and
  a native compile cannot be interrupted, so both run in compile worker processes (`compile_pool`,
  `compile_worker`) under `RLIMIT_AS` and a wall-time limit, and a worker that overruns either is killed: the
  request gets a GrammarError and this process's memory never grows with a grammar. The worker sends the
  result back as xgrammar's own `CompiledGrammar.serialize_json()`, which `deserialize_json` checks against this
  process's tokenizer info; that is sound because the compiled grammar is plain data (rules and per-state
  token masks) and loading it costs what the grammar holds, already bounded by the worker's cap. Compiling
  twice (a bounded trial in the worker, then again here) would double the cost and run the second, unbounded
  compile in this process after all. What xgrammar prints meanwhile (its warnings quote client text) stays in
  the worker and is logged here escaped and bounded, at debug level.
- A JSON schema that only an infinite value can satisfy (`schema_recursion`) is refused before any worker
  sees it (so is a structural tag holding one); the worker also refuses a grammar whose forced start text is
  unbounded (what jump-forward computes).
- `structural_tag` is xgrammar's structural tag (its JSON text), compiled as given; its JSON schemas use
  xgrammar's structural-tag JSON (flexible whitespace unless the tag caps it with `max_whitespace_cnt`). A tag
  whose literal text holds a special token of the model is refused (`UnreachableTag`): the vocabulary here never
  produces one (`structural_tag`).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from typing import Any

import torch
import xgrammar as xgr

import ringserve.kernels.grammar.structural_tag as structural_tag
from ringserve.kernels.grammar.backend import CompiledGrammar, GrammarCompiler, GrammarMatcher
from ringserve.kernels.grammar.compile_pool import WorkerFailure, WorkerPool
from ringserve.kernels.grammar.schema_recursion import infinite_subschema
from ringserve.kernels.grammar.spec import GrammarError, GrammarSpec, UnreachableTag
from ringserve.kernels.grammar.torch_bitmask import set_allowed

log = logging.getLogger("ringserve.kernels.grammar")
DEFAULT_MEMORY_BYTES = 1 << 30  # a worker's room beyond what it holds once loaded
DEFAULT_TIME_LIMIT = 30.0
QUOTE_CHARS = 200

_LABELS = {"json_object": "JSON object", "json_schema": "JSON schema", "regex": "regex", "ebnf": "EBNF grammar",
           "structural_tag": "structural tag"}
# xgrammar's C++ errors start with "[12:50:58] /project/cpp/file.cc:123: " and may carry a failed check.
_LOG_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")
_CHECK_FAILED = re.compile(r"^Check failed: \(.*?\) is false:\s*")


def build_tokenizer_info(tokenizer: Any, vocab_size: int | None = None,
                         stop_token_ids: Sequence[int] | None = None) -> xgr.TokenizerInfo:
    """xgrammar's view of `tokenizer`, with masks `vocab_size` wide (the model's vocabulary).

    Stop tokens default to the tokenizer's eos. Special tokens that are not stops are blanked, which makes
    xgrammar treat them as special (never allowed); ids past the tokenizer's vocabulary are special as well.
    """
    stops = [int(t) for t in stop_token_ids] if stop_token_ids else [int(tokenizer.eos_token_id)]
    base = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stops)
    size = base.vocab_size
    specials = {t for t in special_token_ids(tokenizer) if 0 <= t < size} - set(stops)
    if not specials:
        return base
    vocab = [""] * size
    for token, token_id in tokenizer.get_vocab().items():
        if token_id < size:
            vocab[token_id] = token
    for token_id in specials:
        vocab[token_id] = ""
    return xgr.TokenizerInfo.from_vocab_and_metadata(vocab, base.dump_metadata())


def prepare_vocabulary(tokenizer: Any, vocab_size: int | None = None,
                       stop_token_ids: Sequence[int] | None = None) -> dict[str, Any]:
    """What `XGrammarCompiler` derives from `tokenizer`, as JSON data (`prepared`): the tokenizer info
    (`build_tokenizer_info`, serialized) and the special tokens' texts."""
    info = build_tokenizer_info(tokenizer, vocab_size, stop_token_ids)
    return {"tokenizer_info": info.serialize_json(),
            "special_texts": list(special_token_texts(tokenizer))}


def special_token_ids(tokenizer: Any) -> set[int]:
    """The ids of the tokenizer's special tokens (its special tokens map and the added tokens marked special)."""
    specials = {int(t) for t in getattr(tokenizer, "all_special_ids", ())}
    for token_id, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(added, "special", False):
            specials.add(int(token_id))
    return specials


def special_token_texts(tokenizer: Any) -> tuple[str, ...]:
    """The texts of the tokenizer's special tokens, stop tokens included (no grammar literal can produce one)."""
    texts = tokenizer.convert_ids_to_tokens(sorted(special_token_ids(tokenizer)))
    return tuple(sorted({t for t in texts if isinstance(t, str) and t}))


def _grammar_error(spec: GrammarSpec, exc: Exception) -> GrammarError:
    detail = _CHECK_FAILED.sub("", _LOG_PREFIX.sub("", str(exc).strip()))
    # xgrammar's messages may quote the client's text: bounded, and control characters escaped
    detail = one_line(detail)
    return GrammarError(f"invalid {_LABELS[spec.kind]}: {detail}", spec.kind)


class XGrammarMatcher(GrammarMatcher):
    """A request's matcher over an xgrammar `GrammarMatcher`, tracking the accepted tokens for rebuilds."""

    def __init__(self, matcher: xgr.GrammarMatcher, accepted: list[int] | None = None) -> None:
        self._matcher = matcher
        self._accepted: list[int] = accepted if accepted is not None else []
        self._stops = tuple(matcher.stop_token_ids)

    def accept_token(self, token_id: int) -> bool:
        if self._matcher.is_terminated() or not self._matcher.accept_token(int(token_id)):
            return False
        self._accepted.append(int(token_id))
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._matcher.is_terminated():  # xgrammar raises here; a step in flight may still ask
            set_allowed(bitmask, row, self._stops)
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def is_completed(self) -> bool:
        return self._matcher.is_completed()

    def rollback(self, num_tokens: int) -> None:
        if num_tokens < 0 or num_tokens > len(self._accepted):
            raise ValueError(f"cannot roll back {num_tokens} of {len(self._accepted)} accepted tokens")
        if num_tokens:
            self._matcher.rollback(num_tokens)
            del self._accepted[-num_tokens:]

    def jump_forward(self) -> str:
        if self._matcher.is_terminated():
            return ""
        return self._matcher.find_jump_forward_string()

    def jump_forward_tokens(self) -> list[int]:
        if self._matcher.is_terminated():
            return []
        return self._matcher.find_jump_forward_tokens()

    def copy(self) -> XGrammarMatcher:
        return XGrammarMatcher(self._matcher.fork(), list(self._accepted))

    def reset(self) -> None:
        self._matcher.reset()
        self._accepted.clear()

    @property
    def accepted_tokens(self) -> tuple[int, ...]:
        return tuple(self._accepted)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return self._stops


class XGrammarCompiled(CompiledGrammar):
    """An xgrammar `CompiledGrammar` for one spec."""

    def __init__(self, spec: GrammarSpec, compiled: xgr.CompiledGrammar, vocab_size: int) -> None:
        self.spec = spec
        self.compile_seconds = 0.0
        self._compiled = compiled
        self._vocab_size = vocab_size

    def matcher(self, accepted_tokens: Sequence[int] = ()) -> XGrammarMatcher:
        matcher = XGrammarMatcher(xgr.GrammarMatcher(self._compiled))
        for position, token in enumerate(accepted_tokens):
            if not matcher.accept_token(token):
                raise GrammarError(f"token {token} at position {position} does not match the grammar",
                                   self.spec.kind)
        return matcher

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def memory_bytes(self) -> int:
        return int(self._compiled.memory_size_bytes)


class XGrammarCompiler(GrammarCompiler):
    """Compiles specs with xgrammar for one tokenizer (see the module docstring for the choices made).

    Parsing and compiling run in compile worker processes (`compile_pool`), capped at `memory_bytes` beyond
    what a worker holds once loaded and at `time_limit` seconds per request; the compiled grammar comes back
    as xgrammar's JSON serialization and is loaded against this process's tokenizer info. `max_threads` is
    xgrammar's own parallelism inside one compilation; `compile_threads` is how many compilations (and
    workers) run at once.
    """

    def __init__(self, tokenizer: Any, vocab_size: int | None = None, *, prepared: dict[str, Any] | None = None,
                 stop_token_ids: Sequence[int] | None = None, any_whitespace: bool = False,
                 cache_size: int = 256, compile_threads: int = 2, max_threads: int = 2,
                 memory_bytes: int = DEFAULT_MEMORY_BYTES, time_limit: float = DEFAULT_TIME_LIMIT) -> None:
        """`prepared`: `prepare_vocabulary`'s result for this tokenizer, vocabulary width and stops, made
        before (then `tokenizer` is not read and may be None); without it, it is made here."""
        super().__init__(cache_size=cache_size, compile_threads=compile_threads)
        if prepared is None:
            self.tokenizer_info = build_tokenizer_info(tokenizer, vocab_size, stop_token_ids)
            self.special_texts = special_token_texts(tokenizer)
            info_json = self.tokenizer_info.serialize_json()
        else:
            info_json = prepared["tokenizer_info"]
            self.tokenizer_info = xgr.TokenizerInfo.deserialize_json(info_json)
            self.special_texts = tuple(prepared["special_texts"])
        self.any_whitespace = any_whitespace
        self.memory_bytes = memory_bytes
        setup = {"tokenizer_info": info_json, "memory_bytes": memory_bytes,
                 "max_threads": max_threads, "any_whitespace": any_whitespace}
        self._workers = WorkerPool(setup, size=compile_threads, time_limit=time_limit, on_stderr=_log_printed)
        try:
            self._workers.start()
        except WorkerFailure as exc:  # the first request tries again
            log.warning("starting a grammar compile worker failed: %s", exc)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer_info.vocab_size

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The stop tokens every matcher of this compiler ends on."""
        return tuple(self.tokenizer_info.stop_token_ids)

    @property
    def time_limit(self) -> float:
        """CPU seconds a worker may spend on one request before it is killed (compile_pool's docstring)."""
        return self._workers.time_limit

    def start_workers(self) -> int:
        return self._workers.fill()

    def _check(self, spec: GrammarSpec) -> None:
        self._precheck(spec)
        self._ask("check", spec)

    def _compile(self, spec: GrammarSpec) -> XGrammarCompiled:
        self._precheck(spec)
        text = self._ask("compile", spec)["grammar"]
        try:
            compiled = xgr.CompiledGrammar.deserialize_json(text, self.tokenizer_info)
        except (RuntimeError, ValueError) as exc:  # our own worker's output: a version mismatch at most
            raise GrammarError(f"loading the compiled {_LABELS[spec.kind]} failed: {str(exc)[:200]}",
                               spec.kind) from None
        return XGrammarCompiled(spec, compiled, self.vocab_size)

    def close(self) -> None:
        """Stop the compile threads, then the worker processes."""
        super().close()
        self._workers.close()

    def _ask(self, op: str, spec: GrammarSpec) -> dict[str, Any]:
        """The worker's reply for `spec`; GrammarError when it is invalid, too large, too slow or unbounded."""
        label = _LABELS[spec.kind]
        try:
            reply = self._workers.request({"op": op, "kind": spec.kind, "source": spec.source})
        except WorkerFailure as exc:
            if exc.reason == "unavailable":  # a server fault, not the grammar's: not cached as the grammar's error
                raise RuntimeError(str(exc)) from None
            if exc.reason == "timeout":
                raise GrammarError(f"the {label} took more than {self.time_limit:g} CPU seconds to compile; simplify it",
                                   spec.kind) from None
            if exc.reason == "unbounded":
                raise _unbounded(spec, None) from None
            raise GrammarError(f"the {label} needs more than {self.memory_bytes >> 20} MiB to compile (or crashed "
                               "the compiler); simplify it", spec.kind) from None
        if reply.get("reason") == "unbounded":
            raise _unbounded(spec, str(reply.get("rule", "")))
        if "error" in reply:
            raise _grammar_error(spec, RuntimeError(reply["error"]))
        return reply

    def _precheck(self, spec: GrammarSpec) -> None:
        """What is checked here before a worker sees `spec`: a JSON schema's recursion, a structural tag's schemas
        and literal texts."""
        if spec.kind == "json_schema":
            self._schema_text(spec)
        elif spec.kind == "structural_tag":
            self._tag_text(spec)

    @staticmethod
    def _schema_text(spec: GrammarSpec) -> str:
        """The schema, checked to be JSON here first (Python's message is clearer than xgrammar's) and to need no
        infinite value."""
        try:
            schema = json.loads(spec.source)
        except ValueError as exc:
            raise GrammarError(f"invalid JSON schema: not valid JSON ({exc})", spec.kind) from None
        _check_finite(schema, spec, "JSON schema")
        return spec.source

    def _tag_text(self, spec: GrammarSpec) -> str:
        """The structural tag, checked to be JSON, to hold no schema that needs an infinite value, and to hold no
        special token in its literal texts (UnreachableTag)."""
        try:
            tag = structural_tag.parse_tag(spec.source)
        except ValueError as exc:
            raise GrammarError(f"invalid structural tag: not valid JSON ({exc})", spec.kind) from None
        for schema in structural_tag.schemas(tag):
            _check_finite(schema, spec, "structural tag: its JSON schema")
        found = structural_tag.special_literal(tag, self.special_texts)
        if found is not None:
            raise UnreachableTag(f"invalid structural tag: its text {quote(found[0], 64)} holds the special token "
                                 f"{quote(found[1], 64)}, which a grammar never produces", spec.kind)
        return spec.source


def _check_finite(schema: Any, spec: GrammarSpec, label: str) -> None:
    """GrammarError when only an infinite value satisfies `schema` (a part of it)."""
    where = infinite_subschema(schema)
    if where is not None:
        raise GrammarError(f"invalid {label}: only an infinitely nested value could match {quote(where)}: its "
                           "required properties or items recurse into it with no way out; make the recursion "
                           "optional", spec.kind)


def _unbounded(spec: GrammarSpec, rule: str | None) -> GrammarError:
    """The error for a grammar part that no finite output completes (`rule`: its name, for EBNF)."""
    where = f" (rule {quote(rule, 64)})" if rule and spec.kind == "ebnf" else ""
    return GrammarError(f"the {_LABELS[spec.kind]} can only be matched by an output of unbounded length{where}: a "
                        "part of it must recurse forever once entered; make the recursion optional", spec.kind)


def _log_printed(text: str) -> None:
    """What xgrammar printed while handling a client's grammar: logged escaped and bounded, never raw."""
    log.debug("grammar backend printed %s", quote(text))


def one_line(text: str, limit: int = QUOTE_CHARS) -> str:
    """`text` with control characters escaped (no newline can start a line of its own), cut at `limit`."""
    cut = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:limit])
    return cut + ("..." if len(text) > limit else "")


def quote(text: str, limit: int = QUOTE_CHARS) -> str:
    """`text` as a one-line Python literal, at most about `limit` characters of it (client text in messages)."""
    return repr(text[:limit]) + ("..." if len(text) > limit else "")
