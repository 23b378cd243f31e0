"""The KV cache's second tier (actors/engine/kv_tier/): prefix blocks the pool evicts are kept in host memory or
in files, and a later prompt that continues its cached prefix with them loads them instead of computing them.
Tokens and logprobs equal a tier-less engine's (the loaded K/V is the computed K/V, bit for bit); a restarted
engine loads what an earlier one kept in the directory; a corrupted file is detected and computed instead; other
weights or another `cache_salt` never load a block; the store keeps to its byte bound. A graceful stop saves the
blocks still cached (newest first, within the bound and a time limit), so a restart answers them from disk, in
process and on a ring stopped with a signal; `--kv-tier-write-through` saves each block as it is cached."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from ringserve.actors.engine.kv_tier.store import BlockStore
from ringserve.bus.messages import SamplingParams, TokenizedRequest
from tests.engine_helpers import engine_for, run_to_completion, tiny_hf_llama, tokens_of
from tests.server_helpers import ServerHandle, start_server

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


def test_a_half_written_record_is_never_read_and_cleaned_up_and_a_failed_write_is_a_miss(tmp_path: Path) -> None:
    import os

    BlockStore(1 << 20, tmp_path).put("aa", b"x" * 100)
    stale, fresh = tmp_path / ".bb.tmp", tmp_path / ".cc.tmp"  # a writer killed before its rename; one writing now
    stale.write_bytes(b"half")
    fresh.write_bytes(b"half")
    os.utime(stale, (0, 0))
    reopened = BlockStore(1 << 20, tmp_path)
    assert len(reopened) == 1 and reopened.get("aa") == b"x" * 100 and "bb" not in reopened
    assert not stale.exists() and fresh.exists()
    (tmp_path / ".dd.tmp").mkdir()  # a write that fails (as on a full disk) is a miss, never an error
    assert not reopened.put("dd", b"y" * 100) and "dd" not in reopened and reopened.write_errors == 1


def test_flags_that_cannot_work_together_are_refused() -> None:
    from ringserve.actors.engine.config import EngineConfig

    with pytest.raises(ValueError, match="needs --kv-tier-bytes"):
        EngineConfig(kv_tier_dir="/tmp/x")
    with pytest.raises(ValueError, match="not with --disable-radix-cache"):
        EngineConfig(kv_tier_bytes=1 << 20, disable_radix_cache=True)


def kv_files(directory: Path) -> list[Path]:
    return list(directory.glob("*.kv"))


def test_a_graceful_stop_saves_the_cached_prefixes_and_a_restart_answers_them_from_disk(
        hf: Any, reference: dict[str, Any], tmp_path: Path) -> None:
    first = tiered(hf, kv_tier_dir=str(tmp_path))
    assert_same(answer(first, "first", DOC + [7, 9, 11]), reference["first"])
    assert kv_files(tmp_path) == [] and first.stats().kv_tier_saved_blocks == 0  # cached, nothing evicted
    saved = first.keep_prefix_cache()  # what the scheduler calls on a graceful stop
    assert saved["written_blocks"] == 4 and saved["complete"], saved
    assert len(kv_files(tmp_path)) == 4
    del first
    restarted = tiered(hf, kv_tier_dir=str(tmp_path))
    got = answer(restarted, "second", DOC + [8, 9, 11])
    assert got[2] == 256 and restarted.stats().kv_tier_loaded_blocks == 4
    assert_same(got, reference["second"])
    again = restarted.keep_prefix_cache()  # the blocks it loaded are on disk already: kept, not written again
    assert again["written_blocks"] == 0 and again["kept_blocks"] == 4, again
    restarted.check_integrity()


def test_write_through_puts_each_cached_block_on_disk_before_any_stop(
        hf: Any, reference: dict[str, Any], tmp_path: Path) -> None:
    engine = tiered(hf, kv_tier_dir=str(tmp_path), kv_tier_write_through=True)
    assert_same(answer(engine, "first", DOC + [7, 9, 11]), reference["first"])
    assert len(kv_files(tmp_path)) == 4 and engine.stats().kv_tier_saved_blocks == 4
    del engine  # a crash: no stop saves anything
    restarted = tiered(hf, kv_tier_dir=str(tmp_path), kv_tier_write_through=True)
    got = answer(restarted, "second", DOC + [8, 9, 11])
    assert got[2] == 256
    assert_same(got, reference["second"])
    assert restarted.stats().kv_tier_saved_blocks == 0  # the loaded blocks were not written again
    with pytest.raises(ValueError, match="needs --kv-tier-bytes"):
        from ringserve.actors.engine.config import EngineConfig

        EngineConfig(kv_tier_write_through=True)


def test_a_stop_saves_the_most_recently_used_prefixes_within_the_byte_bound_and_the_time_limit(
        hf: Any, tmp_path: Path) -> None:
    other_doc = random.Random(3).choices(range(3, 500), k=256)
    probe = tiered(hf)  # a block's record size, from this pool's layout
    record = probe.cache.tier.block_bytes + 16
    bound = 2 * record + record // 2  # room for two blocks
    config = dict(max_total_tokens=1024, disable_cuda_graph=True, kv_tier_bytes=bound, kv_tier_dir=str(tmp_path))
    engine = engine_for(hf, **config)
    answer(engine, "older", DOC + [7, 9, 11])
    newest = answer(engine, "newer", other_doc + [7, 9, 11])
    assert engine.cache.save_to_tier(0.0)["kept_blocks"] == 0  # no time: nothing
    saved = engine.keep_prefix_cache()
    assert saved["kept_blocks"] == 2 and not saved["complete"], saved
    files = kv_files(tmp_path)
    assert len(files) == 2 and sum(f.stat().st_size for f in files) <= bound
    del engine
    restarted = engine_for(hf, **config)
    assert answer(restarted, "older again", DOC + [7, 9, 11])[2] == 0
    got = answer(restarted, "newer again", other_doc + [7, 9, 11])
    assert got[2] == 128 and got[0] == newest[0]  # the newest prefix's first two blocks


def test_a_ring_stopped_by_a_signal_answers_its_cached_prompt_from_disk_after_a_restart(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    flags = ["--kv-tier-bytes", str(64 << 20), "--kv-tier-dir", str(tmp_path)]
    prompt = "A long shared context about colours and shapes, kept across a restart. " * 12

    def complete(server: ServerHandle) -> Any:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=120)
        return client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=8,
                                         temperature=0)

    first = start_server(str(tiny_model_dir), extra=flags)
    try:
        before = complete(first)
    finally:
        assert first.stop(drain=True) == 0, first.log()[-3000:]  # Ctrl-C once: the ring drains and stops
    assert before.usage.prompt_tokens_details.cached_tokens == 0
    assert kv_files(tmp_path), first.log()[-3000:]
    restarted = start_server(str(tiny_model_dir), extra=flags)
    try:
        after = complete(restarted)
    finally:
        restarted.stop()
    assert after.usage.prompt_tokens_details.cached_tokens >= 64  # whole blocks, loaded from disk
    assert after.choices[0].text == before.choices[0].text
