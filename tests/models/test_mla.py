"""Latent attention (actors/engine/models/mla.py) beyond the per-family comparisons with transformers in
tests/models/test_model_families.py: the KV pool holds one latent per token (its bytes what the config implies,
its V its K), the compiled decode graph writes the latent in place and gives transformers' tokens, a yarn-scaled DeepSeek
(its mscale folded into the softmax scale) matches transformers past its original context, the Triton backend
(under its interpreter on a CPU) runs the latent pool, and two tensor-parallel ranks give the unsharded engine's
tokens and logprobs."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

from ringserve.actors.engine.runner.kv_pool import KVPool
from ringserve.bus.messages import TokenizedRequest
from tests.engine_helpers import (assert_greedy_matches, compiled_engine, engine_for, greedy, hf_greedy,
                                  run_to_completion, tokens_of)
from tests.model_families import CONFIGS, VOCAB, tiny_hf_model
from tests.models.test_engine_model import assert_steps_match
from tests.scale_out.test_tensor_parallel import _check_close, _run_waves, _spawn_group


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (length + 3 * i,), generator=gen).tolist() for i in range(count)]


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_the_pool_holds_one_latent_per_token(family: str) -> None:
    hf = tiny_hf_model(family)
    config = hf.config
    engine = engine_for(hf, max_total_tokens=256)
    pool = engine.pool
    latent = config.kv_lora_rank + config.qk_rope_head_dim
    assert pool.v is pool.k and tuple(pool.k.shape[2:]) == (1, latent)
    per_token = config.num_hidden_layers * latent * 4  # float32
    full = config.num_hidden_layers * config.num_attention_heads * (
        config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim) * 4  # K and V per head
    model = engine.runner.model
    assert KVPool.bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim, model.dtype,
                                  model.latent_kv) == per_token < full
    assert engine.stats().kv_pool["bytes_per_token"] == str(per_token)


def test_the_compiled_decode_graph_writes_the_latent_and_gives_transformers_tokens(
        monkeypatch: pytest.MonkeyPatch) -> None:
    hf = tiny_hf_model("deepseek_v3")
    engine = compiled_engine(hf, monkeypatch)
    seq = prompts(1, 9, seed=2)[0]
    rows = run_to_completion(engine, [TokenizedRequest("g", seq, greedy(10))])
    assert_greedy_matches(hf, seq, hf_greedy(hf, seq, 10, None), tokens_of(rows["g"]))


def test_a_yarn_scaled_deepseek_matches_transformers_past_its_original_context() -> None:
    """DeepSeek's yarn with mscale and mscale_all_dim: the rotary attention factor and the softmax scale's
    mscale², past the original context of 16 positions."""
    base = CONFIGS["deepseek_v2"]

    def yarn() -> Any:
        config = base()
        # mscale apart from mscale_all_dim: the rotary factor is their mscales' ratio, not 1
        config.rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                                  "mscale_all_dim": 0.707, "original_max_position_embeddings": 16,
                                  "beta_fast": 32, "beta_slow": 1}
        return config

    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(CONFIGS, "deepseek_v2", yarn)
        hf = tiny_hf_model("deepseek_v2")
    from ringserve.actors.engine.models.weights import model_from_hf

    model = model_from_hf(hf.config, hf.state_dict())
    assert model.layer_attention()[0].scale != (hf.config.qk_nope_head_dim + hf.config.qk_rope_head_dim) ** -0.5
    assert_steps_match(model, hf, prompts(2, 20, seed=3), tol=2e-4, name="deepseek_v2 yarn")


def test_a_deepseek_v3_checkpoint_loads_without_its_multi_token_prediction_layer() -> None:
    """DeepSeek-V3's checkpoints hold `num_nextn_predict_layers` layers past `num_hidden_layers` (an MTP
    module: a decoder layer plus its projections), which transformers leaves out and so do we."""
    from ringserve.actors.engine.models.weights import model_from_hf

    hf = tiny_hf_model("deepseek_v3")
    last, extra = hf.config.num_hidden_layers - 1, hf.config.num_hidden_layers
    state = dict(hf.state_dict())
    state.update({name.replace(f"model.layers.{last}.", f"model.layers.{extra}."): t
                  for name, t in hf.state_dict().items() if name.startswith(f"model.layers.{last}.")})
    hidden = hf.config.hidden_size
    state[f"model.layers.{extra}.eh_proj.weight"] = torch.zeros(hidden, 2 * hidden)
    state[f"model.layers.{extra}.enorm.weight"] = torch.ones(hidden)
    assert_steps_match(model_from_hf(hf.config, state), hf, prompts(1, 6, seed=7), tol=2e-4, name="deepseek_v3")


def test_the_triton_backend_runs_the_latent_pool() -> None:
    """Store (written once), decode and extend kernels over the one-head latent pool (40 dims, not a power of
    two), chunked prefill's second chunks extending over what the pool holds."""
    pytest.importorskip("triton")
    from ringserve.kernels.triton import interpreter_enabled

    if not torch.cuda.is_available() and not interpreter_enabled():
        pytest.skip("triton was imported before TRITON_INTERPRET was set in this process")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf = tiny_hf_model("deepseek_v2")
    engine = engine_for(hf, attention_backend="triton", device=device, chunked_prefill_size=8, max_total_tokens=256)
    seqs = prompts(2, 11, seed=5)
    rows = run_to_completion(engine, [TokenizedRequest(f"t{i}", seq, greedy(6)) for i, seq in enumerate(seqs)])
    for i, seq in enumerate(seqs):
        assert_greedy_matches(hf, seq, hf_greedy(hf, seq, 6, None), tokens_of(rows[f"t{i}"]))


# DeepSeek-V3 (a low-rank query): DeepSeek-V2 with --tp 2 runs through the ring
# (tests/models/test_server_model_families.py)
@pytest.mark.parametrize("family", ["deepseek_v3"])
def test_two_ranks_split_the_heads_over_the_whole_latent(family: str) -> None:
    hf = tiny_hf_model(family)
    waves = [[(f"d{i}", p, 8) for i, p in enumerate(prompts(3, 5, seed=4))]]
    want = _run_waves(engine_for(hf, chunked_prefill_size=4), waves)
    results, _ = _spawn_group(2, [("mla", {"model": family, "chunked_prefill_size": 4}, waves)])
    assert isinstance(results[0], dict), results
    _check_close(want, results[0]["mla"])


def test_an_fp8_checkpoint_is_refused_by_name() -> None:
    """DeepSeek-V3's official checkpoints store FP8 weights with `weight_scale_inv` scales: refused saying so."""
    from ringserve.actors.engine.models.weights import model_from_hf

    hf = tiny_hf_model("deepseek_v3")
    tensors = dict(hf.state_dict())
    tensors["model.layers.1.self_attn.o_proj.weight_scale_inv"] = torch.ones(1, 1)
    with pytest.raises(ValueError, match="block-scaled FP8 weights .*weight_scale_inv"):
        model_from_hf(hf.config, tensors)
