"""Latent attention over tensor-parallel ranks: each rank keeps `1/tp` of the heads over the whole latent.

The latent (`kv_a_proj_with_mqa`, its norm) is every head's, so every rank computes and caches it whole (the
KV pool is the same on each rank, as SGLang's and vLLM's MLA under tensor parallelism); the query projection
(`q_proj`, or `q_b_proj` after the replicated `q_a_proj`) and `kv_b_proj` keep the rank's heads' rows, and
`o_proj` its heads' columns, all-reduced. `num_attention_heads % tp == 0` is checked first (tp_checks.py).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ringserve.actors.engine.parallel.tensor_parallel import TPGroup, column_parallel, row_parallel


def shard_latent_attention(attn: Any, group: TPGroup) -> None:
    """Keep `group.rank`'s heads of a `LatentAttention` (in place)."""
    heads = attn.num_heads // group.size
    first = group.rank * heads
    qk, kv = attn.nope + attn.rope, attn.nope + attn.v_dim
    if attn.q_proj is not None:
        attn.q_proj = column_parallel(attn.q_proj, [(first * qk, (first + heads) * qk)])
    else:
        attn.q_b_proj = column_parallel(attn.q_b_proj, [(first * qk, (first + heads) * qk)])
    weight = attn.kv_b_proj.weight[first * kv:(first + heads) * kv]
    attn.kv_b_proj.weight = nn.Parameter(weight.contiguous().clone(), requires_grad=False)
    attn.o_proj = row_parallel(attn.o_proj, first * attn.v_dim, (first + heads) * attn.v_dim, group)
    attn.num_heads = heads
