"""The grammar compiler's vocabulary cache (actors/common/grammar_vocab.py), in-process with SmolLM2's exported
tokenizer and the real xgrammar backend: the first compiler made for a model keeps xgrammar's view of its
vocabulary in ringserve's cache (a temporary one here) and says it made it; the next start reads it back without
loading transformers' tokenizer and says it read it; what it reads is what transformers' tokenizer gives; a
damaged entry is made again; and a compiler made from the cached vocabulary constrains output to its schema."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

VOCAB = 49152
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def exported_tokenizer() -> Any:
    """SmolLM2's tokenizer as the actors load it (the tokenizer export), transformers' not loaded."""
    from ringserve.actors.common.model_source import DEFAULT_MODEL, resolve_model
    from ringserve.actors.common.text_tokenizer import load_text_model

    return load_text_model(resolve_model(DEFAULT_MODEL)).tokenizer


@pytest.fixture(scope="module")
def user_cache() -> Path:
    """The user's ringserve cache, where SmolLM2's tokenizer export already is (each test's `plan_dir` is not)."""
    from ringserve.actors.common.model_source import cache_root

    return cache_root()


@pytest.fixture(scope="module")
def tokenizer(user_cache: Path) -> Any:
    return exported_tokenizer()


def test_the_vocabulary_is_made_once_then_read_from_the_cache(tokenizer: Any, plan_dir: Path, user_cache: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from ringserve.actors.common import startup_cache
    from ringserve.actors.common.grammar_vocab import CACHE_ENTRY, cache_path, prepared_vocabulary
    from ringserve.actors.common.text_tokenizer import transformers_tokenizer
    from ringserve.kernels.grammar import prepare_vocabulary

    path = cache_path(tokenizer, VOCAB)
    assert path is not None and plan_dir in path.parents and not path.exists()
    made = prepared_vocabulary(tokenizer, VOCAB, path)
    assert path.is_file() and CACHE_ENTRY in startup_cache.report()["cache_made"]

    monkeypatch.setenv("RINGSERVE_CACHE", str(user_cache))
    fresh = exported_tokenizer()  # a later start: its own tokenizer, transformers' never loaded
    monkeypatch.setenv("RINGSERVE_CACHE", str(plan_dir))
    assert cache_path(fresh, VOCAB) == path
    assert prepared_vocabulary(fresh, VOCAB, path) == made
    assert fresh._transformers is None
    assert CACHE_ENTRY in startup_cache.report()["cache_read"]
    assert made == prepare_vocabulary(transformers_tokenizer(tokenizer), VOCAB)  # what the uncached path makes
    assert cache_path(tokenizer, VOCAB + 64) != path  # another width is another entry

    path.write_text('{"tokenizer_info": ')  # a damaged entry (a full disk, an interrupted write elsewhere)
    assert prepared_vocabulary(tokenizer, VOCAB, path) == made
    assert json.loads(path.read_text()) == made


def test_a_compiler_from_the_cached_vocabulary_constrains_output(tokenizer: Any, plan_dir: Path) -> None:
    from ringserve.actors.common.grammar_vocab import cache_path, grammar_compiler
    from ringserve.kernels.grammar import GrammarSpec

    compiler = grammar_compiler(tokenizer, VOCAB, compile_threads=1)
    try:
        assert cache_path(tokenizer, VOCAB).is_file()  # type: ignore[union-attr]
        assert compiler.vocab_size == VOCAB and tokenizer.eos_token_id in compiler.stop_token_ids
        matcher = compiler.compile(GrammarSpec("json_schema", json.dumps(SCHEMA))).matcher()
        assert not matcher.accept_token(tokenizer.encode("[", add_special_tokens=False)[0])
        for token in tokenizer.encode('{"ok": true}', add_special_tokens=False):
            assert matcher.accept_token(token), tokenizer.decode([token])
        assert matcher.accept_token(tokenizer.eos_token_id) and matcher.is_terminated()
    finally:
        compiler.close()
