"""A whole decoder layer of a decode step as one CPU op (`decode_layer.cpp`), its torch reference, and the
model's entry point.

`torch.ops.ringserve_cpu.decode_layer(x, cos, sin, norm1, norm2, eps, qweights, scales, mins, biases, bits,
out_features, k_pool, v_pool, layer, out_slots, table, rows, kv_lens, num_heads, scale, window=0, soft_cap=0.0)`
runs a Llama layer
(actors/engine/models/llama.py's `DecoderLayer`) for `M` rows, each one request's single new token: `x` `[M, C]`,
cos/sin `[M, D]` of the rows' positions, the two RMSNorm weights, the four linears (qkv, o, gate_up, down) as
packed group-of-32 weights (kernels/cpu/packing.py), and the paged attention inputs of
kernels/cpu/attention.py (the layer's scale, sliding window and logit soft-cap included). It writes each row's
K/V at `out_slots` of `layer` and returns the layer's output.
At batch 1 a layer is one call and one OpenMP team instead of ten ops and their Python (the .cpp says why).

`fused_decode_layer` is what the model calls: it runs the op where it applies (every linear runs a group
kernel at this row count, the backend reads the pool in place and the step is decode rows only) and returns
None otherwise, so the layer's own modules run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ringserve.kernels.cpu.attention import reference_paged_decode_attention
from ringserve.kernels.cpu.packing import reference_group_linear


def reference_decode_layer(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm1: torch.Tensor,
                           norm2: torch.Tensor, eps: float, qweights: list[torch.Tensor], scales: list[torch.Tensor],
                           mins: list[torch.Tensor | None], biases: list[torch.Tensor | None], bits: list[int],
                           out_features: list[int], k_pool: torch.Tensor, v_pool: torch.Tensor, layer: int,
                           out_slots: torch.Tensor, table: torch.Tensor, rows: torch.Tensor, kv_lens: torch.Tensor,
                           num_heads: int, scale: float, window: int = 0, soft_cap: float = 0.0) -> torch.Tensor:
    """The op's math in plain torch, the model's op order: its fallback and what the kernel is tested against."""
    m = x.shape[0]
    hkv, d = k_pool.shape[2], k_pool.shape[3]

    def linear(i: int, h: torch.Tensor) -> torch.Tensor:
        return reference_group_linear(h, qweights[i], scales[i], mins[i], biases[i], out_features[i], bits[i])

    def norm(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))

    def rotary(h: torch.Tensor) -> torch.Tensor:  # [M, heads, D]
        half = d // 2
        rotated = torch.cat((-h[..., half:], h[..., :half]), dim=-1)
        return h * cos[:, None, :] + rotated * sin[:, None, :]

    q, k, v = linear(0, norm(x, norm1)).split([num_heads * d, hkv * d, hkv * d], dim=-1)
    q, k = rotary(q.reshape(m, num_heads, d)), rotary(k.reshape(m, hkv, d))
    k_pool[layer].index_copy_(0, out_slots, k)
    v_pool[layer].index_copy_(0, out_slots, v.reshape(m, hkv, d))
    attn = reference_paged_decode_attention(q, k_pool[layer], v_pool[layer], table, rows, kv_lens, scale, window,
                                            soft_cap)
    x = x + linear(1, attn.reshape(m, num_heads * d))
    gate, up = linear(2, norm(x, norm2)).chunk(2, dim=-1)
    return x + linear(3, F.silu(gate) * up)


def fused_decode_layer(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norms: Sequence[Any],
                       linears: Sequence[Any], num_heads: int, layer: int, backend: Any,
                       meta: Any) -> torch.Tensor | None:
    """The layer's output `[T, C]` through the one op, or None where it does not apply (the caller then runs
    the layer's modules). `norms`: the two RMSNorms (`weight`, `eps`); `linears`: qkv, o, gate_up, down;
    `backend`/`meta`: the step's attention backend and metadata."""
    attention = backend.in_place_decode_inputs(meta, layer)
    if attention is None or x.dtype != torch.float32 or norms[0].eps != norms[1].eps:
        return None
    rows = x.shape[0]
    # a quantized linear (kernels.quantization.QuantLinear, which imports this package: hence no isinstance)
    # has `packed_for`; any other linear leaves the layer to its modules
    packed = [linear.packed_for(rows) if hasattr(linear, "packed_for") else None for linear in linears]
    if any(p is None or p.format not in ("q8_0", "q4_0", "q4_1") for p in packed):  # the op reads only these
        return None
    table, table_rows, kv_lens, spec = attention
    return torch.ops.ringserve_cpu.decode_layer.default(
        x, cos, sin, norms[0].weight, norms[1].weight, norms[0].eps, [p.qweight for p in packed],
        [p.scales for p in packed], [p.mins for p in packed], [linear.bias for linear in linears],
        [p.bits for p in packed], [p.out_features for p in packed], backend.k_pool, backend.v_pool, layer,
        meta.out_slots, table, table_rows, kv_lens, num_heads, spec.scale, spec.window or 0, spec.soft_cap or 0.0)
