"""Every rotary variant (models/rope.py) against transformers' own rotary embedding: cos/sin at positions inside
and past the original context, token by token as decode steps compute them, and (the length-dependent variants,
`dynamic` and `longrope`) a whole prompt past the original context rotated for its length, as transformers' one
forward over it."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from ringserve.actors.engine.models.rope import Rotary, rope_parameters

ORIGINAL = 32
HEAD_DIM = 16

VARIANTS: dict[str, dict[str, Any]] = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "yarn-mscale": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.5,
                    "beta_fast": 16, "beta_slow": 2, "original_max_position_embeddings": ORIGINAL},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0},
    "longrope": {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": ORIGINAL,
                 "short_factor": [1.0 + 0.1 * i for i in range(HEAD_DIM // 2)],
                 "long_factor": [2.0 + 0.5 * i for i in range(HEAD_DIM // 2)]},
    "partial": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
}


def hf_rotary(params: dict[str, Any]) -> tuple[Any, Any]:
    """transformers' config and rotary embedding module for `params` (Phi-3's for longrope and partial rotary,
    Llama's otherwise)."""
    from transformers import LlamaConfig, Phi3Config
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    phi3 = params["rope_type"] == "longrope" or "partial_rotary_factor" in params  # Llama's rotates whole heads
    config_class, rotary_class = (Phi3Config, Phi3RotaryEmbedding) if phi3 else (LlamaConfig, LlamaRotaryEmbedding)
    max_positions = 4 * ORIGINAL if params["rope_type"] != "dynamic" else ORIGINAL
    config = config_class(hidden_size=HEAD_DIM * 4, num_attention_heads=4, num_key_value_heads=4,
                          max_position_embeddings=max_positions, original_max_position_embeddings=ORIGINAL,
                          rope_parameters=copy.deepcopy(params))
    return config, rotary_class(config)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cos_sin_match_transformers_per_decode_position(variant: str) -> None:
    config, hf = hf_rotary(VARIANTS[variant])
    ours = Rotary(rope_parameters(config), HEAD_DIM, config.max_position_embeddings)
    x = torch.zeros(1, 1, HEAD_DIM)
    # in increasing order, as a sequence grows: transformers' dynamic variant keeps the longest length it saw
    positions = sorted(set(range(0, 3 * ORIGINAL, 5)) | {ORIGINAL - 1, ORIGINAL, ORIGINAL + 1})
    cos, sin = ours(torch.tensor(positions), torch.float32)  # one step holding every position
    for i, p in enumerate(positions):  # transformers one position per forward: a decode step's
        hf_cos, hf_sin = hf(x, torch.tensor([[p]]))
        torch.testing.assert_close(cos[i], hf_cos[0, 0], atol=1e-6, rtol=1e-5, msg=lambda m: f"{variant} @{p}: {m}")
        torch.testing.assert_close(sin[i], hf_sin[0, 0], atol=1e-6, rtol=1e-5, msg=lambda m: f"{variant} @{p}: {m}")


def test_unknown_rope_type_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="unsupported rope_type 'su'"):
        rope_parameters(type("C", (), {"rope_parameters": {"rope_type": "su", "rope_theta": 1.0}})())


def test_older_configs_rope_scaling_fields_are_read() -> None:
    old = type("C", (), {"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}})()
    assert rope_parameters(old) == {"type": "linear", "factor": 2.0, "rope_theta": 5e5, "rope_type": "linear"}


@pytest.mark.parametrize("variant", ["dynamic", "longrope"])
def test_a_long_prompt_is_rotated_for_its_whole_length(variant: str) -> None:
    config, hf = hf_rotary(VARIANTS[variant])
    ours = Rotary(rope_parameters(config), HEAD_DIM, config.max_position_embeddings)
    length = ORIGINAL + 9
    positions = torch.arange(length)
    hf_cos, hf_sin = hf(torch.zeros(1, 1, HEAD_DIM), positions[None])  # one forward over the whole prompt
    cos, sin = ours(positions, torch.float32, torch.full((length,), length))
    torch.testing.assert_close(cos, hf_cos[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(sin, hf_sin[0], atol=1e-6, rtol=1e-5)
    own_cos, _ = ours(positions, torch.float32)  # each token's own length: the early tokens turn otherwise
    assert not torch.allclose(own_cos[:ORIGINAL], hf_cos[0, :ORIGINAL], atol=1e-4)
