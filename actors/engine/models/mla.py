"""DeepSeek's multi-head latent attention (MLA, DeepSeek-V2/V3), over a KV pool that holds each token's latent.

Per token the pool keeps what the architecture caches, not full keys and values: the normed KV latent `c`
(`kv_lora_rank` values) and the roped shared key `k_pe` (`qk_rope_head_dim`), as one "KV head" of
`kv_lora_rank + qk_rope_head_dim` values whose leading `kv_lora_rank` are also the values (the pool's V is its
K: runner/kv_pool.py). The attention is the absorbed form: `kv_b_proj` holds each head's `W_UK` (latent -> nope
key) and `W_UV` (latent -> value); a head's score `q_nope · (W_UK c) + q_pe · k_pe` is
`(q_nope W_UK) · c + q_pe · k_pe`, so the query is taken into latent space (`[q_nope W_UK, q_pe]`), attends over
`[c, k_pe]` with the latent as values, and the head's output latent goes through `W_UV` before `o_proj`. Every
attention backend runs it as multi-query attention (one KV head), so the prefix cache, chunked prefill,
retraction, decode graphs and prompt logprobs work on it unchanged. Prefill uses the absorbed form too; the
expanded form (full per-head keys for the prompt, fewer dot products per key when `kv_lora_rank` exceeds
`qk_nope_head_dim`) would be an optimisation of long prefills, not done.

Rotary: DeepSeek rotates interleaved pairs of the rope dimensions (V2 always, V3 with `rope_interleave`); the
family files permute those rows of the checkpoint to the half-split layout at load (`deinterleave_rope`), after
which the shared `apply_rotary` gives the same dot products. `kv_b_proj` stays a float weight (not a linear
that quantization would swap): the absorbed projections are read from it directly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch import nn

from ringserve.actors.engine.execution_plan import NormRotaryKernels
from ringserve.actors.engine.models.blocks import make_norm
from ringserve.actors.engine.models.rope import apply_rotary
from ringserve.actors.engine.models.spec import LayerShape
from ringserve.kernels.attention import AttentionBackend, AttentionMetadata


class LatentProjection(nn.Module):
    """`kv_b_proj`: latent -> each head's nope key and value, `weight` `[H * (nope + v), kv_lora_rank]`."""

    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))


class LatentAttention(nn.Module):
    """Multi-head latent attention for one layer; `forward` `[T, C]` -> `[T, C]`; `kernels` builds its norms
    (`blocks.make_norm`)."""

    latent_kv = True  # the pool holds one latent per token (K and V one tensor)

    def __init__(self, shape: LayerShape, layer: int, kernels: NormRotaryKernels = "torch") -> None:
        super().__init__()
        config = shape.config
        self.layer = layer
        self.num_heads, self.num_kv_heads = config.num_attention_heads, 1
        self.nope, self.rope = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.lora = config.v_head_dim, config.kv_lora_rank
        self.head_dim = self.lora + self.rope  # one token's entry in the pool
        qk = self.nope + self.rope
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(shape.hidden, self.num_heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(shape.hidden, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = make_norm(config.q_lora_rank, shape.norm_eps, kernels=kernels)
            self.q_b_proj = nn.Linear(config.q_lora_rank, self.num_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(shape.hidden, self.lora + self.rope, bias=bias)
        self.kv_a_layernorm = make_norm(self.lora, shape.norm_eps, kernels=kernels)
        self.kv_b_proj = LatentProjection(self.num_heads * (self.nope + self.v_dim), self.lora)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, shape.hidden, bias=bias)
        self.rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = apply_rotary

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend,
                meta: AttentionMetadata) -> torch.Tensor:
        t, h = x.shape[0], self.num_heads
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))  # type: ignore[misc]
        q_nope, q_pe = q.view(t, h, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.lora, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent)  # [T, L]
        q_pe = self.rotary(q_pe, cos, sin)  # [T, H, R]
        k_pe = self.rotary(k_pe.reshape(t, 1, self.rope), cos, sin)  # [T, 1, R]
        w = self.kv_b_proj.weight.view(h, self.nope + self.v_dim, self.lora)
        q_latent = torch.einsum("thn,hnl->thl", q_nope, w[:, :self.nope])  # [T, H, L]: the query in latent space
        kv = torch.cat([latent.reshape(t, 1, self.lora), k_pe], dim=-1)  # [T, 1, L + R]
        out = backend.forward(torch.cat([q_latent, q_pe], dim=-1), kv, kv, self.layer, meta)  # [T, H, L + R]
        values = torch.einsum("thl,hvl->thv", out[..., :self.lora], w[:, self.nope:])  # [T, H, V]
        return self.o_proj(values.reshape(t, h * self.v_dim))


def deinterleave_rope(tensors: Mapping[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """The checkpoint with the rope rows of every layer's query projection (per head) and of
    `kv_a_proj_with_mqa` reordered from interleaved pairs `(0, 1), (2, 3), ...` to halves `0, 2, ... | 1, 3, ...`."""
    rope, nope, lora = config.qk_rope_head_dim, config.qk_nope_head_dim, config.kv_lora_rank
    order = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    out = dict(tensors)
    for name, tensor in tensors.items():
        if not name.startswith("model.layers."):
            continue
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
            heads = tensor.view(config.num_attention_heads, nope + rope, -1)
            out[name] = torch.cat([heads[:, :nope], heads[:, nope:][:, order]], dim=1).reshape(tensor.shape)
        elif name.endswith(("self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_proj_with_mqa.bias")):
            out[name] = torch.cat([tensor[:lora], tensor[lora:][order]])
    return out
