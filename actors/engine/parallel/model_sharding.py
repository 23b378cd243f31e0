"""A whole model sharded over tensor-parallel ranks, each layer by its kind: dense attention and MLPs as
tensor_parallel.py splits them, latent attention as mla_shard.py, mixture-of-experts layers as moe_shard.py."""

from __future__ import annotations

from ringserve.actors.engine.models.causal_lm import CausalLM
from ringserve.actors.engine.models.mla import LatentAttention
from ringserve.actors.engine.models.moe import SparseMoE
from ringserve.actors.engine.parallel.mla_shard import shard_latent_attention
from ringserve.actors.engine.parallel.moe_shard import shard_experts
from ringserve.actors.engine.parallel.tensor_parallel import TPGroup, shard_attention, shard_mlp
from ringserve.actors.engine.parallel.tp_checks import check_shardable


def shard_model(model: CausalLM, group: TPGroup, expert_parallel: bool = False) -> CausalLM:
    """Keep only `group.rank`'s shard of each layer's attention and MLP (in place, before any quantization);
    the row-parallel layers all-reduce over `group`. Mixture-of-experts layers slice every expert, or with
    `expert_parallel` keep whole experts per rank (actors/engine/parallel/moe_shard.py); latent attention keeps
    a slice of the heads over the whole latent (actors/engine/parallel/mla_shard.py)."""
    config, tp = model.config, group.size
    check_shardable(config, tp)
    if tp == 1:
        return model
    for layer in model.decoder_layers():  # per-head q/k norms and every other norm stay whole
        if isinstance(layer.self_attn, LatentAttention):
            shard_latent_attention(layer.self_attn, group)
        else:
            shard_attention(layer.self_attn, config, group)
        if isinstance(layer.mlp, SparseMoE):
            shard_experts(layer.mlp, group, expert_parallel)
        else:
            shard_mlp(layer.mlp, group)
    model.tp = group  # type: ignore[assignment]  # what the engine's builders look for
    return model
