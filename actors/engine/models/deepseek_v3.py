"""DeepSeek-V3 (and R1, V3.1, Kimi K2's layout): DeepSeek-V2's latent attention with a low-rank query
(`q_lora_rank`), and experts scored by a sigmoid, chosen with a correction bias (`e_score_correction_bias`)
among the best `topk_group` of `n_group` groups (each ranked by its best two scores), the chosen weights
renormalised (`norm_topk_prob`) and scaled by `routed_scaling_factor`, plus shared experts. The rope dimensions
are interleaved pairs in the checkpoint when `rope_interleave` (the default). The checkpoints' multi-token
prediction layers (`model.layers.{num_hidden_layers}...`, `num_nextn_predict_layers` of them) are left out, as
transformers leaves them."""

import re
from typing import Any

from ringserve.actors.engine.models.deepseek_v2 import DEEPSEEK_RENAMES, routed_experts, shared_inner, sparse_after_dense
from ringserve.actors.engine.models.mla import deinterleave_rope
from ringserve.actors.engine.models.spec import ArchSpec, MoESpec


def decoder_tensors(tensors: Any, config: Any) -> dict[str, Any]:
    """The checkpoint's tensors less its multi-token prediction layers (those numbered from
    `num_hidden_layers` on), which transformers does not load either."""
    layer = re.compile(r"model\.layers\.(\d+)\.")
    return {name: t for name, t in tensors.items()
            if not ((m := layer.match(name)) and int(m.group(1)) >= config.num_hidden_layers)}


def _prepare(tensors: Any, config: Any) -> Any:
    """The decoder's tensors (no multi-token prediction layer), their rope rows in the half-split layout."""
    kept = decoder_tensors(tensors, config)
    return deinterleave_rope(kept, config) if getattr(config, "rope_interleave", True) else kept


SPEC = ArchSpec(
    name="deepseek_v3", mla=True, hf_renames=DEEPSEEK_RENAMES, prepare_weights=_prepare,
    moe=MoESpec(num_experts=routed_experts, inner=lambda config: config.moe_intermediate_size,
                is_sparse=sparse_after_dense, scoring="sigmoid", renormalize=lambda config: bool(config.norm_topk_prob),
                group_score=lambda config: "top2", routed_scale=lambda config: float(config.routed_scaling_factor),
                score_bias=True, shared_inner=shared_inner))
