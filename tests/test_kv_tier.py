"""The KV cache's second tier (actors/engine/kv_tier/): prefix blocks the pool evicts are kept in host memory or
in files, and a later prompt that continues its cached prefix with them loads them instead of computing them.
Tokens and logprobs equal a tier-less engine's (the loaded K/V is the computed K/V, bit for bit); a restarted
engine loads what an earlier one kept in the directory; a corrupted file is detected and computed instead; other
weights or another `cache_salt` never load a block; the store keeps to its byte bound."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from ringserve.actors.engine.kv_tier.store import BlockStore
from ringserve.bus.messages import SamplingParams, TokenizedRequest
from tests.engine_helpers import engine_for, run_to_completion, tiny_hf_llama, tokens_of

POOL = 400  # tokens: a document of 256 is evicted by the filler requests
DOC = random.Random(1).choices(range(3, 500), k=256)  # four whole 64-token blocks
TIER = 64 << 20


def request(rid: str, prompt: list[int], salt: str | None = None) -> TokenizedRequest:
    return TokenizedRequest(rid, prompt, SamplingParams(max_new_tokens=8, temperature=0.0, return_logprob=True,
                                                        cache_salt=salt))


def answer(engine: Any, rid: str, prompt: list[int], salt: str | None = None) -> tuple[list[int], list[float], int]:
    """Greedy tokens, their logprobs and the cached prompt tokens of one request run alone."""
    rows = run_to_completion(engine, [request(rid, prompt, salt)])[rid]
    return tokens_of(rows), [lp for row in rows for lp in row.logprobs], rows[0].cached_tokens


def evict_everything(engine: Any) -> None:
    """Fill the pool with other prompts until nothing of the document is cached."""
    rng = random.Random(2)
    for i in range(3):
        answer(engine, f"filler{i}", rng.choices(range(3, 500), k=300))


@pytest.fixture(scope="module")
def hf() -> Any:
    return tiny_hf_llama(max_position_embeddings=1024)


@pytest.fixture(scope="module")
def reference(hf: Any) -> dict[str, tuple[list[int], list[float], int]]:
    """Every question's answer from an engine without a tier: after the first, the document is the prefix
    cache's (computed by the first request, as the tier's blocks were); "fresh" computes it all in one prefill."""
    engine = engine_for(hf, max_total_tokens=POOL, disable_cuda_graph=True)
    out = {q: answer(engine, q, DOC + [7 + i, 9, 11]) for i, q in enumerate(("first", "second", "third"))}
    fresh = engine_for(hf, max_total_tokens=POOL, disable_cuda_graph=True)
    return {**out, "fresh third": answer(fresh, "third", DOC + [9, 9, 11])}


def tiered(hf: Any, **config: Any) -> Any:
    return engine_for(hf, max_total_tokens=POOL, disable_cuda_graph=True, kv_tier_bytes=TIER, **config)


def assert_same(got: tuple[list[int], list[float], int], want: tuple[list[int], list[float], int]) -> None:
    assert got[0] == want[0]
    torch.testing.assert_close(torch.tensor(got[1]), torch.tensor(want[1]), atol=0, rtol=0)


@pytest.mark.parametrize("where", ["memory", "disk"])
def test_an_evicted_document_is_loaded_not_computed_and_answers_the_same(
        hf: Any, reference: dict[str, Any], tmp_path: Path, where: str) -> None:
    engine = tiered(hf, kv_tier_dir=str(tmp_path) if where == "disk" else "")
    assert_same(answer(engine, "first", DOC + [7, 9, 11]), reference["first"])
    evict_everything(engine)
    info = engine.stats()
    assert info.kv_tier_saved_blocks >= 4 and info.kv_tier_blocks >= 4, info
    if where == "disk":
        assert len(list(tmp_path.glob("*.kv"))) == info.kv_tier_blocks
    got = answer(engine, "second", DOC + [8, 9, 11])
    assert got[2] == 256  # the document's four blocks came from the tier
    assert_same(got, reference["second"])
    info = engine.stats()
    assert info.kv_tier_loaded_blocks == 4 and info.kv_tier_loaded_bytes > 0 and info.kv_tier_load_seconds > 0
    engine.check_integrity()


def test_a_restarted_engine_loads_what_the_directory_kept_and_drops_a_corrupted_block(
        hf: Any, reference: dict[str, Any], tmp_path: Path) -> None:
    first = tiered(hf, kv_tier_dir=str(tmp_path))
    answer(first, "first", DOC + [7, 9, 11])
    evict_everything(first)
    del first
    restarted = tiered(hf, kv_tier_dir=str(tmp_path))
    got = answer(restarted, "second", DOC + [8, 9, 11])
    assert got[2] == 256 and restarted.stats().kv_tier_loaded_blocks == 4
    assert_same(got, reference["second"])

    again = tiered(hf, kv_tier_dir=str(tmp_path))
    for file in tmp_path.glob("*.kv"):  # every block damaged (one byte each): the document's first one is
        raw = bytearray(file.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        file.write_bytes(bytes(raw))
    got = answer(again, "third", DOC + [9, 9, 11])
    assert got[2] == 0 and again.stats().kv_tier_corrupt_blocks >= 1
    assert_same(got, reference["fresh third"])


def test_other_weights_or_another_salt_never_load_a_block(hf: Any, tmp_path: Path) -> None:
    engine = tiered(hf, kv_tier_dir=str(tmp_path))
    answer(engine, "salted", DOC + [7, 9, 11], salt="tenant-a")
    evict_everything(engine)
    assert answer(engine, "unsalted", DOC + [8, 9, 11])[2] == 0  # a's blocks are not the shared tree's
    assert engine.stats().kv_tier_loaded_blocks == 0
    assert answer(engine, "same salt", DOC + [9, 9, 11], salt="tenant-a")[2] == 256
    other = engine_for(tiny_hf_llama(seed=5, max_position_embeddings=1024), max_total_tokens=POOL, disable_cuda_graph=True, kv_tier_bytes=TIER,
                       kv_tier_dir=str(tmp_path))
    assert answer(other, "other weights", DOC + [8, 9, 11], salt="tenant-a")[2] == 0
    assert other.stats().kv_tier_loaded_blocks == 0


def test_the_store_keeps_to_its_byte_bound_least_recently_used_out(tmp_path: Path) -> None:
    for directory in (None, tmp_path):
        store = BlockStore(3 * 1016, directory)
        for i in range(5):
            store.put(f"{i:02x}", bytes([i]) * 1000)
        assert len(store) == 3 and store.bytes <= 3 * 1016 and "00" not in store and "04" in store
        assert store.get("02") == bytes([2]) * 1000  # now the most recently used
        store.put("05", b"x" * 1000)
        assert "02" in store and "03" not in store
    reopened = BlockStore(2 * 1016, tmp_path)  # a smaller bound: the oldest files go at once
    assert len(reopened) == 2 and len(list(tmp_path.glob("*.kv"))) == 2


def test_flags_that_cannot_work_together_are_refused() -> None:
    from ringserve.actors.engine.config import EngineConfig

    with pytest.raises(ValueError, match="needs --kv-tier-bytes"):
        EngineConfig(kv_tier_dir="/tmp/x")
    with pytest.raises(ValueError, match="not with --disable-radix-cache"):
        EngineConfig(kv_tier_bytes=1 << 20, disable_radix_cache=True)
