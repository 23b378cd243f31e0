"""A Llama forward pass in one file, over a flat batch of new tokens from many requests.

Shapes: `T` new tokens in the step, `B` requests, `H`/`Hkv` query/KV heads, `D` head dim, `C` hidden size,
`V` vocab. Parameter names mirror Hugging Face's `LlamaForCausalLM`, except that the q/k/v projections are
fused into one `qkv_proj` and gate/up into one `gate_up_proj` (one GEMM each instead of three and two;
`fuse_hf_state_dict` converts a HF state dict). Op order follows HF's (RMSNorm in float32, rotary cos/sin
from float32 frequencies) so greedy decoding matches it token for token. Attention goes through an
`AttentionBackend`; the model itself holds no KV cache.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ringserve.kernels.attention import AttentionBackend, AttentionMetadata
from ringserve.kernels.cpu.decode_layer import fused_decode_layer

SUPPORTED_ROPE_TYPES = ("default",)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, scaled by `weight` in the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """Default (unscaled) rotary position embedding; gives cos/sin `[T, D]` for the step's positions."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        # Explicit CPU device so the buffer is real even when the model is built on the meta device.
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", 1.0 / (theta**exponents), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """`[x1, x2] -> [-x2, x1]` over the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[T, heads, D]` by cos/sin `[T, D]`."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return (x * cos) + (rotate_half(x) * sin)


class Attention(nn.Module):
    """Grouped-query self-attention; the backend writes K/V into the paged pool and attends."""

    def __init__(self, config: Any, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(hidden, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, hidden, bias=bias)
        # swappable for a fused kernel (model_runner.use_triton_kernels), as the norms are
        self.rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = apply_rotary

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: AttentionBackend,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.reshape(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.reshape(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        q, k = self.rotary(q, cos, sin), self.rotary(k, cos, sin)
        out = backend.forward(q, k, v, self.layer, meta)  # [T, H, D]
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))  # [T, C]


class MLP(nn.Module):
    """SwiGLU feed-forward: `down(silu(gate(x)) * up(x))`."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_up_proj = nn.Linear(hidden, 2 * inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: attention and MLP, each with a residual connection."""

    def __init__(self, config: Any, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Set where a decode step's whole layer may run as one CPU op (model_runner.use_cpu_decode_layers).
        self.fused_decode = False

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: AttentionBackend,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if self.fused_decode:
            attn, mlp = self.self_attn, self.mlp
            out = fused_decode_layer(x, cos, sin, (self.input_layernorm, self.post_attention_layernorm),
                                     (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj), attn.num_heads,
                                     attn.layer, backend, meta)
            if out is not None:
                return out
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, backend, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Embeddings, decoder layers and final norm (HF's `model.` prefix)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        # No random init: every tensor is assigned from the checkpoint. On the meta device (where weights.py
        # builds the model) Embedding's normal_ alone imports ~900 modules: ~1.8 s of every start.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(head_dim_of(config), rope_theta_of(config))


class LlamaForCausalLM(nn.Module):
    """Llama with a language-model head; `forward` returns next-token logits of each request."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}: only 'silu' is implemented")
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding matrix with the LM head when the config says so."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        meta: AttentionMetadata,
        logits_index: torch.Tensor,
    ) -> torch.Tensor:
        """`input_ids`, `positions` `[T]` -> logits `[S, V]` at the `S` token indices in `logits_index`."""
        x = self.model.embed_tokens(input_ids)  # [T, C]
        cos, sin = self.model.rotary_emb(positions, x.dtype)  # [T, D] each
        for layer in self.model.layers:
            x = layer(x, cos, sin, backend, meta)
        x = self.model.norm(x[logits_index])  # [S, C]; the norm is per row, so select first
        return self.lm_head(x)  # [S, V]


FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def fuse_hf_state_dict(tensors: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """A HF Llama state dict with each layer's q/k/v and gate/up weights (and biases) concatenated."""
    out = dict(tensors)
    for i in range(num_layers):
        for fused, parts in FUSED.items():
            for kind in ("weight", "bias"):
                names = [f"model.layers.{i}.{part}.{kind}" for part in parts]
                if names[0] in out:
                    out[f"model.layers.{i}.{fused}.{kind}"] = torch.cat([out.pop(n) for n in names])
    return out


def head_dim_of(config: Any) -> int:
    """Per-head dimension: `config.head_dim` when set, else hidden size / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_theta_of(config: Any) -> float:
    """RoPE base from `rope_parameters` (transformers 5) or `rope_theta`; rejects scaled RoPE variants."""
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}: only {SUPPORTED_ROPE_TYPES} are implemented")
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError("config has no rope_theta (neither in rope_parameters nor as an attribute)")
    return float(theta)
