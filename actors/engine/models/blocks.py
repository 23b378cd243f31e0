"""The building blocks every dense architecture is declared from: RMSNorm, attention and the gated MLP (the
decoder layer that assembles them, with the mixture-of-experts and latent-attention blocks, is decoder_layer.py).

Shapes: `T` new tokens in the step, `H`/`Hkv` query/KV heads, `D` head dim, `C` hidden size. Parameter names
mirror Hugging Face's, except that q/k/v are fused into one `qkv_proj` and gate/up into one `gate_up_proj` (one
GEMM each instead of three and two). Op order follows transformers' (norms in float32, rotary cos/sin from
float32 frequencies) so greedy decoding matches it token for token. What varies between families is a
`Blocks` value (models/spec.py); attention goes through an `AttentionBackend`, and no block holds KV.
"""

from __future__ import annotations

import torch
from torch import nn

from ringserve.actors.engine.execution_plan import NormRotaryKernels
from ringserve.actors.engine.models.rope import Rotation, apply_rotary
from ringserve.actors.engine.models.spec import LayerShape
from ringserve.kernels.activations import ACTIVATIONS
from ringserve.kernels.attention import AttentionBackend, AttentionMetadata


class RMSNorm(nn.Module):
    """Root-mean-square norm in float32. Llama's scales by `weight` in the input dtype; Gemma's (`unit_offset`)
    by `1 + weight` in float32, as each family's transformers code does."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (h * (1.0 + self.weight.float())).to(dtype)
        return self.weight * h.to(dtype)


def make_norm(dim: int, eps: float, unit_offset: bool = False, kernels: NormRotaryKernels = "torch") -> nn.Module:
    """An RMSNorm as the execution plan's `kernels` say: the fused Triton kernel's module (same `weight` and
    `eps`; it scales by `weight`, so never a `unit_offset` norm) or ours."""
    if kernels == "triton" and not unit_offset:
        from ringserve.kernels.triton.rmsnorm import TritonRMSNorm  # triton is imported only where it runs

        return TritonRMSNorm(nn.Parameter(torch.ones(dim)), eps)
    return RMSNorm(dim, eps, unit_offset)


class Attention(nn.Module):
    """Grouped-query self-attention with optional q/k/v bias, q/k norms (per head, or over the whole projection)
    and partial rotary, or none (a NoPE layer); how the layer attends (scale, window, soft-cap) is its
    `LayerAttention`, applied by the backend. `kernels` builds its q/k norms (`make_norm`); `rotary` rotates its
    queries and keys (`models/rope.py` `apply_rotary`, or the Triton kernel the execution plan chose)."""

    latent_kv = False  # the pool holds keys and values apart (models/mla.py's attention holds one latent)

    def __init__(self, shape: LayerShape, layer: int, kernels: NormRotaryKernels = "torch",
                 rotary: Rotation = apply_rotary) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(shape.hidden, self.q_size + 2 * self.kv_size, bias=shape.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, shape.hidden, bias=shape.o_bias)
        self.q_norm = self.k_norm = None
        self.norm_projection = shape.qk_norm and shape.qk_norm_scope == "projection"
        if shape.qk_norm:
            q_dim, k_dim = (self.q_size, self.kv_size) if self.norm_projection else (self.head_dim, self.head_dim)
            self.q_norm = make_norm(q_dim, shape.norm_eps, shape.norm_unit_offset, kernels)
            self.k_norm = make_norm(k_dim, shape.norm_eps, shape.norm_unit_offset, kernels)
        self.rotates = shape.rotary
        self.rotary = rotary

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend,
                meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.norm_projection:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(t, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.reshape(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.reshape(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.q_norm is not None and not self.norm_projection:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotates:
            q, k = self.rotary(q, cos, sin), self.rotary(k, cos, sin)
        out = backend.forward(q, k, v, self.layer, meta)  # [T, H, D]
        return self.o_proj(out.reshape(t, self.q_size))  # [T, C]


class GatedMLP(nn.Module):
    """`down(act(gate(x)) * up(x))`: SwiGLU with silu, GeGLU with Gemma's tanh-approximated gelu."""

    def __init__(self, shape: LayerShape) -> None:
        super().__init__()
        if shape.activation not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {shape.activation!r}: implemented are {sorted(ACTIVATIONS)}")
        self.inner = shape.intermediate
        self.activation = shape.activation
        self.act = ACTIVATIONS[shape.activation]
        self.gate_up_proj = nn.Linear(shape.hidden, 2 * shape.intermediate, bias=shape.mlp_bias)
        self.down_proj = nn.Linear(shape.intermediate, shape.hidden, bias=shape.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)
