"""GLM-4.5 / GLM-4.6 (`Glm4MoeForCausalLM`): grouped-query attention with q/k/v biases (`attention_bias`), a
partial rotary embedding (`partial_rotary_factor`, half of each head by default) and per-head q/k norms when
`use_qk_norm`; past the first `first_k_dense_replace` dense layers, DeepSeek-V3's experts: sigmoid scores chosen
with a correction bias among the best `topk_group` of `n_group` groups, renormalised, scaled by
`routed_scaling_factor`, plus shared experts. Its multi-token prediction layers are left out, as transformers
leaves them."""

from typing import Any

from ringserve.actors.engine.models.deepseek_v2 import DEEPSEEK_RENAMES, routed_experts, shared_inner, sparse_after_dense
from ringserve.actors.engine.models.deepseek_v3 import decoder_tensors
from ringserve.actors.engine.models.spec import ArchSpec, MoESpec


def _qk_norm(config: Any) -> bool:
    return bool(getattr(config, "use_qk_norm", False))


SPEC = ArchSpec(
    name="glm4_moe", qk_norm=_qk_norm, o_bias=lambda config: False, hf_renames=DEEPSEEK_RENAMES,
    prepare_weights=decoder_tensors,
    moe=MoESpec(num_experts=routed_experts, inner=lambda config: config.moe_intermediate_size,
                is_sparse=sparse_after_dense, scoring="sigmoid", renormalize=lambda config: bool(config.norm_topk_prob),
                group_score=lambda config: "top2", routed_scale=lambda config: float(config.routed_scaling_factor),
                score_bias=True, shared_inner=shared_inner))
