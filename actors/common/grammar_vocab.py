"""The grammar compiler of a model's tokenizer, with what the compiler derives from the tokenizer cached per model.

Making a grammar compiler reads transformers' tokenizer of the model (seconds to load: Gemma 3's vocabulary has
262k tokens) and derives xgrammar's tokenizer info from it (seconds more). Both the scheduler and the tokenizer
actor make one at every start, before they report ready (`--grammar-warm-up`). So the first start keeps what it
derived (`kernels.grammar.prepare_vocabulary`: plain JSON) in ringserve's cache, keyed by the tokenizer export's
key (the model's tokenizer files and the libraries that read them), the grammar backend's version and the
vocabulary's width; later starts read it back and never load transformers' tokenizer for the compiler. The
entry is reported as `grammar vocabulary` in the actor's ready line (actors/common/startup_cache.py).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from ringserve.actors.common import startup_cache
from ringserve.actors.common.model_source import cache_root
from ringserve.actors.common.text_tokenizer import TextTokenizer, export_key, transformers_tokenizer

log = logging.getLogger("grammar_vocab")
FORMAT = 1  # bump when what is kept changes
CACHE_ENTRY = "grammar vocabulary"


def grammar_compiler(tokenizer: Any, vocab_size: int, **options: Any) -> Any:
    """`kernels.grammar.make_compiler` for `tokenizer` (a TextTokenizer or transformers' own) and the model's
    `vocab_size`, its vocabulary read from the cache where a start before made it. `options` go to
    `make_compiler` (stop_token_ids excepted: the cached vocabulary ends on the tokenizer's eos)."""
    from ringserve.kernels.grammar import make_compiler

    path = cache_path(tokenizer, vocab_size)
    if path is None or "stop_token_ids" in options:
        return make_compiler(transformers_tokenizer(tokenizer), vocab_size, **options)
    return make_compiler(None, vocab_size, prepared=prepared_vocabulary(tokenizer, vocab_size, path), **options)


def cache_path(tokenizer: Any, vocab_size: int) -> Path | None:
    """Where the vocabulary of `tokenizer` (an exported TextTokenizer with its model source) is kept; None for
    a tokenizer that has no cache key (transformers' own)."""
    source = tokenizer.source if isinstance(tokenizer, TextTokenizer) else None
    if source is None:
        return None
    versions = ":".join(importlib.metadata.version(p) for p in ("xgrammar", "transformers"))
    key = hashlib.sha256(f"{FORMAT}|{versions}|{export_key(source)}|{vocab_size}".encode()).hexdigest()[:24]
    return cache_root() / "grammar-vocab" / f"{key}.json"


def prepared_vocabulary(tokenizer: Any, vocab_size: int, path: Path) -> dict[str, Any]:
    """The prepared vocabulary kept at `path`, or made from transformers' tokenizer now and kept there."""
    try:
        prepared: dict[str, Any] = json.loads(path.read_text())
        startup_cache.note(CACHE_ENTRY, True)
        return prepared
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as exc:  # a damaged entry is made again
        log.warning("the cached grammar vocabulary %s is unreadable (%r); making it again", path, exc)
    from ringserve.kernels.grammar import prepare_vocabulary

    prepared = prepare_vocabulary(transformers_tokenizer(tokenizer), vocab_size)
    _write(path, json.dumps(prepared))
    startup_cache.note(CACHE_ENTRY, False)
    return prepared


def _write(path: Path, text: str) -> None:
    """Write `text` to `path` whole or not at all (the scheduler and the tokenizer may both write it at once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(dir=path.parent, prefix=".staging-")
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.replace(staging, path)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise
