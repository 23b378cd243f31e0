"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v bias) with mixture-of-experts layers whose
softmax router keeps its top-k weights as they are unless `norm_topk_prob`, plus a shared expert scaled by
sigmoid(`shared_expert_gate`). Layers in `mlp_only_layers`, or off the `decoder_sparse_step`, are dense."""

from typing import Any

from ringserve.actors.engine.models.spec import ArchSpec, MoESpec, config_value


def experts(config: Any) -> int:
    """Routed experts (`num_experts`, serialised as `num_local_experts` by Qwen3-MoE)."""
    return config_value(config, "num_experts", "num_local_experts")


def qwen_sparse_layer(config: Any, layer: int) -> bool:
    """Qwen's rule for which layers are mixture-of-experts layers."""
    return (layer not in (getattr(config, "mlp_only_layers", None) or []) and experts(config) > 0
            and (layer + 1) % config.decoder_sparse_step == 0)


SPEC = ArchSpec(
    name="qwen2_moe", qkv_bias=lambda config: getattr(config, "qkv_bias", True), o_bias=lambda config: False,
    moe=MoESpec(num_experts=experts, inner=lambda config: config.moe_intermediate_size,
                is_sparse=qwen_sparse_layer, renormalize=lambda config: bool(config.norm_topk_prob),
                shared_inner=lambda config: config.shared_expert_intermediate_size, shared_gate=True),
    hf_renames=((r"\.shared_expert_gate\.weight$", ".shared_expert_gate"),))
