"""Qwen3-MoE: Qwen3's attention (q/k norms) with mixture-of-experts layers (softmax router, top-k renormalised when
`norm_topk_prob`, no shared expert); layers in `mlp_only_layers`, or off the `decoder_sparse_step`, are dense."""

from ringserve.actors.engine.models.qwen2_moe import experts, qwen_sparse_layer
from ringserve.actors.engine.models.spec import ArchSpec, MoESpec

SPEC = ArchSpec(
    name="qwen3_moe", qk_norm=True,
    moe=MoESpec(num_experts=experts, inner=lambda config: config.moe_intermediate_size,
                is_sparse=qwen_sparse_layer, renormalize=lambda config: bool(config.norm_topk_prob)))
