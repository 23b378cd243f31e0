"""Tiny random-weight models of every architecture family we serve, built with transformers' own config and
model classes, for comparing our engine's outputs with transformers'.

Weights are drawn with std 0.3 (norm weights near their identity) so greedy choices are not near-ties. Sliding
windows are 6 tokens, so the tests' prompts cross them; rope-scaled variants have an original context of 32.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

VOCAB = 256
WINDOW = 6
ORIGINAL_CONTEXT = 32
COMMON: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _llama3() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**COMMON, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL_CONTEXT})


def _mistral() -> Any:
    from transformers import MistralConfig

    return MistralConfig(**COMMON, head_dim=16, sliding_window=WINDOW)


def _qwen2() -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(**COMMON)


def _qwen3() -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(**{**COMMON, "tie_word_embeddings": True}, head_dim=16)


def _gemma2() -> Any:
    from transformers import Gemma2Config

    return Gemma2Config(**{**COMMON, "tie_word_embeddings": True}, head_dim=16, sliding_window=WINDOW,
                        query_pre_attn_scalar=24, attn_logit_softcapping=4.0, final_logit_softcapping=8.0,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"])


def _gemma3() -> Any:
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(**{**COMMON, "tie_word_embeddings": True}, head_dim=16, sliding_window=WINDOW,
                            query_pre_attn_scalar=24,
                            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                             "full_attention": {"rope_type": "linear", "rope_theta": 1e6,
                                                                "factor": 8.0}})


def _phi3() -> Any:
    from transformers import Phi3Config

    rotary_half = 16 * 3 // 4 // 2  # head_dim 16, partial_rotary_factor 0.75
    return Phi3Config(**COMMON, original_max_position_embeddings=ORIGINAL_CONTEXT, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
        "short_factor": [1.0 + 0.1 * i for i in range(rotary_half)],
        "long_factor": [2.0 + 0.5 * i for i in range(rotary_half)],
        "original_max_position_embeddings": ORIGINAL_CONTEXT})


# Mixture-of-experts models: 8 experts of which 2 (DeepSeek-V3: 2 of the 2 best of 4 groups) per token, a dense
# first layer where the family allows it
MOE: dict[str, Any] = dict(moe_intermediate_size=32, num_experts_per_tok=2)


def _mixtral() -> Any:
    from transformers import MixtralConfig

    return MixtralConfig(**{**COMMON, "intermediate_size": 32}, num_local_experts=8, num_experts_per_tok=2,
                         sliding_window=None)


def _qwen2_moe() -> Any:
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(**COMMON, **MOE, num_experts=8, shared_expert_intermediate_size=64, norm_topk_prob=False,
                          mlp_only_layers=[0])


def _qwen3_moe() -> Any:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**COMMON, **MOE, head_dim=16, num_experts=8, norm_topk_prob=True)


# Latent attention: a 32-dim latent and 8 rotary dims per token (40 floats) where full K/V would hold 4 heads of
# 24 + 16 dims
MLA: dict[str, Any] = dict(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                           num_key_value_heads=4, first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=1)


def _deepseek_v2() -> Any:
    from transformers import DeepseekV2Config

    return DeepseekV2Config(**{**COMMON, **MOE, **MLA}, q_lora_rank=None, topk_method="group_limited_greedy",
                            n_group=4, topk_group=2, routed_scaling_factor=1.5)


def _deepseek_v3() -> Any:
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**{**COMMON, **MOE, **MLA}, q_lora_rank=48, n_group=4, topk_group=2,
                            routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True)


def _smollm3() -> Any:
    from transformers import SmolLM3Config

    return SmolLM3Config(**COMMON, head_dim=16, no_rope_layers=[1, 0, 1], use_sliding_window=True,
                         sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention", "sliding_attention"])


def _olmo2() -> Any:
    from transformers import Olmo2Config

    return Olmo2Config(**COMMON)


def _olmo3() -> Any:
    from transformers import Olmo3Config

    return Olmo3Config(**COMMON, sliding_window=WINDOW,
                       layer_types=["sliding_attention", "full_attention", "sliding_attention"])


def _exaone4() -> Any:
    from transformers import Exaone4Config

    return Exaone4Config(**COMMON, head_dim=16, sliding_window=WINDOW, sliding_window_pattern=2)


def _seed_oss() -> Any:
    from transformers import SeedOssConfig

    return SeedOssConfig(**COMMON, head_dim=16, attention_bias=True, attention_out_bias=True)


def _ernie4_5() -> Any:
    from transformers import Ernie4_5Config

    return Ernie4_5Config(**COMMON, head_dim=16, use_bias=True)


def _glm4_moe() -> Any:
    from transformers import Glm4MoeConfig

    return Glm4MoeConfig(**{**COMMON, **MOE}, head_dim=16, n_routed_experts=8, n_shared_experts=1,
                         first_k_dense_replace=1, n_group=4, topk_group=2, norm_topk_prob=True,
                         routed_scaling_factor=2.5, partial_rotary_factor=0.5, use_qk_norm=True, attention_bias=True)


CONFIGS: dict[str, Callable[[], Any]] = {"llama3": _llama3, "mistral": _mistral, "qwen2": _qwen2, "qwen3": _qwen3,
                                         "gemma2": _gemma2, "gemma3": _gemma3, "phi3": _phi3, "mixtral": _mixtral,
                                         "qwen2_moe": _qwen2_moe, "qwen3_moe": _qwen3_moe,
                                         "deepseek_v2": _deepseek_v2, "deepseek_v3": _deepseek_v3,
                                         "smollm3": _smollm3, "olmo2": _olmo2, "olmo3": _olmo3, "exaone4": _exaone4,
                                         "seed_oss": _seed_oss, "ernie4_5": _ernie4_5, "glm4_moe": _glm4_moe}


def tiny_hf_model(family: str, seed: int = 0) -> Any:
    """The family's tiny random model as transformers builds it (eager attention: soft-capping needs it)."""
    return tiny_hf_from_config(CONFIGS[family](), seed)


def tiny_hf_from_config(config: Any, seed: int = 0) -> Any:
    """A random model of `config` as transformers builds it, its weights drawn as every tiny family's."""
    from transformers import AutoModelForCausalLM

    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    gemma = config.model_type.startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # Gemma's norms scale by 1 + weight: near identity either way
                p.copy_(torch.randn_like(p) * 0.1 + (0.0 if gemma else 1.0))
            else:
                p.normal_(0.0, 0.3)
    return model.eval()
