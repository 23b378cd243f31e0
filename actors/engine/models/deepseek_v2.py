"""DeepSeek-V2 (and V2-Lite): multi-head latent attention (models/mla.py; the query straight from `q_proj` when
`q_lora_rank` is unset, as in V2-Lite) and, past the first `first_k_dense_replace` dense layers, experts routed
by a softmax, limited to the best `topk_group` of `n_group` groups (by each group's best score) when
`topk_method` is `group_limited_greedy`, weights not renormalised but scaled by `routed_scaling_factor`, plus
`n_shared_experts` shared experts. Its rope dimensions are interleaved pairs in the checkpoint."""

from typing import Any

from ringserve.actors.engine.models.mla import deinterleave_rope
from ringserve.actors.engine.models.spec import ArchSpec, MoESpec, config_value


def routed_experts(config: Any) -> int:
    """Routed experts (`n_routed_experts`; transformers' alias names too)."""
    return config_value(config, "n_routed_experts", "num_local_experts", "num_experts")


def sparse_after_dense(config: Any, layer: int) -> bool:
    """DeepSeek's rule: every layer from `first_k_dense_replace` on is a mixture-of-experts layer."""
    return layer >= (config.first_k_dense_replace or 0)


def shared_inner(config: Any) -> int:
    """The shared experts' intermediate size: one MLP `n_shared_experts` experts wide."""
    return config.moe_intermediate_size * (config.n_shared_experts or 0)


DEEPSEEK_RENAMES = ((r"\.mlp\.shared_experts\.", ".mlp.shared_expert."),)

SPEC = ArchSpec(
    name="deepseek_v2", mla=True, hf_renames=DEEPSEEK_RENAMES, prepare_weights=deinterleave_rope,
    moe=MoESpec(num_experts=routed_experts, inner=lambda config: config.moe_intermediate_size,
                is_sparse=sparse_after_dense, renormalize=lambda config: False,
                group_score=lambda config: "max" if config.topk_method == "group_limited_greedy" else None,
                routed_scale=lambda config: float(config.routed_scaling_factor), shared_inner=shared_inner))
