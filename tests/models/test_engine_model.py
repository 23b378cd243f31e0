"""Our Llama forward against transformers' on a tiny random model: prefill, extend over a cached prefix, decode."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ringserve.actors.engine.runner.kv_pool import KVPool
from ringserve.actors.engine.models.causal_lm import CausalLM
from ringserve.actors.common.model_catalog import UnsupportedArchitecture
from ringserve.actors.engine.runner.token_table import TokenTable
from ringserve.actors.engine.models.weights import model_from_hf
from ringserve.kernels.attention import ForwardInfo, create_backend
from tests.engine_helpers import tiny_hf_llama


class PagedRunner:
    """Feeds chunks of several sequences through our model with a real paged KV pool, returning raw logits."""

    def __init__(self, model: CausalLM, num_seqs: int, backend: str = "torch") -> None:
        self.model = model
        pool = KVPool(model.num_layers, 256, model.num_kv_heads, model.head_dim, dtype=torch.float32,
                      device=torch.device("cpu"))
        self.table = TokenTable(num_seqs, 128, torch.device("cpu"), pool.scratch_slot)
        self.backend = create_backend(backend, pool.k, pool.v, model.num_heads, model.layer_attention())
        self.rows = [self.table.assign() for _ in range(num_seqs)]
        self.lengths = [0] * num_seqs
        self.free = torch.randperm(256)  # scattered slots

    def feed(self, chunks: list[list[int]]) -> torch.Tensor:
        """Append `chunks[b]` to sequence `b` (all sequences, in one batch); logits `[B, V]` of each last token."""
        starts = list(self.lengths)
        q_lens = [len(c) for c in chunks]
        kv_lens = [s + n for s, n in zip(starts, q_lens)]
        out_slots = []
        for row, start, n in zip(self.rows, starts, q_lens):
            slots, self.free = self.free[:n], self.free[n:]
            self.table.write(row, start, slots)
            out_slots.append(slots)
        info = ForwardInfo(q_lens, kv_lens, torch.tensor(self.rows), self.table.table, torch.cat(out_slots))
        input_ids = torch.tensor([t for c in chunks for t in c])
        positions = torch.tensor([p for s, n in zip(starts, q_lens) for p in range(s, s + n)])
        self.lengths = kv_lens
        last = torch.tensor(q_lens).cumsum(0) - 1
        return self.model(input_ids, positions, self.backend, self.backend.prepare(info), last)


@torch.no_grad()
def hf_last_logits(hf: Any, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0, -1]


@pytest.mark.parametrize("tied", [False, True])
def test_logits_match_transformers_through_prefill_extend_and_decode(tied: bool) -> None:
    hf = tiny_hf_llama(tie_word_embeddings=tied)
    model = model_from_hf(hf.config, hf.state_dict())
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (4, 7, 12)]
    # The extend chunk of the first sequence is a single token: one step mixes decode and extend rows.
    assert_steps_match(model, hf, seqs, tol=1e-4)


def assert_steps_match(model: CausalLM, hf: Any, seqs: list[list[int]], tol: float, name: str = "") -> None:
    """Our logits for `seqs` fed as a prefill of 2 tokens, an extend and a decode step (all sequences in each
    step, over scattered pool slots) equal transformers' for the same prefixes within `tol`."""
    runner = PagedRunner(model, len(seqs))
    plan = [[s[:2] for s in seqs], [s[2:-1] for s in seqs], [s[-1:] for s in seqs]]  # prefill, extend, decode
    done = [0] * len(seqs)
    for chunks in plan:
        logits = runner.feed(chunks)
        for b, chunk in enumerate(chunks):
            done[b] += len(chunk)
            torch.testing.assert_close(logits[b], hf_last_logits(hf, seqs[b][: done[b]]), atol=tol, rtol=tol,
                                       msg=lambda m: f"{name} sequence {b} at {done[b]} tokens: {m}")


def test_unknown_rope_types_and_architectures_are_refused_naming_them() -> None:
    hf = tiny_hf_llama()
    config = hf.config
    config.rope_parameters = {"rope_type": "su", "rope_theta": 5e5}
    with pytest.raises(ValueError, match="unsupported rope_type 'su'"):
        model_from_hf(config, hf.state_dict())
    config.rope_parameters = {"rope_type": "default", "rope_theta": 1e4}
    config.architectures = ["FalconForCausalLM"]
    with pytest.raises(UnsupportedArchitecture, match="FalconForCausalLM; served are: LlamaForCausalLM"):
        model_from_hf(config, hf.state_dict())


def test_the_resolved_config_is_transformers_config_read_back_without_it(tmp_path: Any, monkeypatch: Any) -> None:
    """Starts read the model's config from the cache instead of importing transformers: the packaged GGUF's and
    a safetensors directory's resolved config agree with transformers', and the second read comes from the file
    (transformers' loader is not called again)."""
    from ringserve.actors.common import model_source
    from ringserve.actors.common.model_source import DEFAULT_MODEL, load_config, resolve_model, resolved_config
    from ringserve.actors.engine.models.weights import _config_mismatches

    tiny = tmp_path / "tiny"
    tiny_hf_llama().save_pretrained(tiny)
    for source in (resolve_model(DEFAULT_MODEL), resolve_model(str(tiny))):
        hf = load_config(source)
        if source.gguf_file is None:  # written here (the GGUF's may come from the session's cache)
            monkeypatch.setenv("RINGSERVE_CACHE", str(tmp_path / "cache"))
        kept = resolved_config(source)
        assert _config_mismatches(hf, kept) == []
        assert (kept.model_type, kept.rope_parameters, kept.tie_word_embeddings) == (
            hf.model_type, hf.rope_parameters, hf.tie_word_embeddings)
        with monkeypatch.context() as patched:
            patched.setattr(model_source, "load_config", lambda _: pytest.fail("transformers was asked again"))
            assert vars(resolved_config(source)) == vars(kept)


def test_a_safetensors_directory_loads_without_transformers_sharded_or_not(tmp_path: Any, monkeypatch: Any) -> None:
    """Our loader reads the checkpoint's own tensors (one file, or shards with their index) in the asked dtype:
    the same logits as transformers' model."""
    from ringserve.actors.common.model_source import resolve_model
    from ringserve.actors.engine.models.weights import SHARD_INDEX, load_model

    monkeypatch.setenv("RINGSERVE_CACHE", str(tmp_path / "cache"))
    hf = tiny_hf_llama()
    ids = torch.tensor([[1, 5, 9, 200, 7]])
    with torch.no_grad():
        want = hf(ids).logits[0]
    for name, shard in (("whole", "5GB"), ("sharded", "100KB")):
        directory = tmp_path / name
        hf.save_pretrained(directory, max_shard_size=shard)
        assert (directory / SHARD_INDEX).is_file() == (name == "sharded")
        model = load_model(resolve_model(str(directory)), torch.float32, "cpu")
        runner = PagedRunner(model, 1)
        torch.testing.assert_close(runner.feed([ids[0].tolist()])[0], want[-1], rtol=1e-4, atol=1e-4)
        assert load_model(resolve_model(str(directory)), torch.bfloat16, "cpu").lm_head.weight.dtype == torch.bfloat16
