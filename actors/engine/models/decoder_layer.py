"""The decoder layer: an attention block and an MLP block, each with a residual, assembled as the layer's
`LayerShape` says: grouped-query `Attention` or DeepSeek's `LatentAttention` (models/mla.py), a dense `GatedMLP`
or a mixture of experts (`SparseMoE`, models/moe.py), and the norms around them, each built as the engine's
`ExecutionPlan` chose (norm and rotary kernels, the fused CPU decode op, the experts' path)."""

from __future__ import annotations

import torch
from torch import nn

from ringserve.actors.engine.execution_plan import ExecutionPlan
from ringserve.actors.engine.models.blocks import Attention, GatedMLP, make_norm
from ringserve.actors.engine.models.mla import LatentAttention
from ringserve.actors.engine.models.moe import SparseMoE
from ringserve.actors.engine.models.rope import Rotation, apply_rotary
from ringserve.actors.engine.models.spec import LayerShape
from ringserve.kernels.attention import AttentionBackend, AttentionMetadata
from ringserve.kernels.cpu.decode_layer import fused_decode_layer


class DecoderLayer(nn.Module):
    """Pre-norm block: attention and MLP, each with a residual. With `sandwich_norms` (Gemma 2/3) each sublayer's
    output is normed too, and the pre-MLP norm is `pre_feedforward_layernorm`; with `post_norms` (OLMo 2/3,
    EXAONE 4) only each sublayer's output is normed (HF's names for all three layouts). `plan`: the engine's
    execution plan; `rotary`: what rotates queries and keys (`rope.rotation`)."""

    def __init__(self, shape: LayerShape, layer: int, plan: ExecutionPlan = ExecutionPlan(),
                 rotary: Rotation = apply_rotary) -> None:
        super().__init__()
        kernels = plan.norm_rotary_kernels
        norm = lambda: make_norm(shape.hidden, shape.norm_eps, shape.norm_unit_offset, kernels)  # noqa: E731
        self.self_attn: nn.Module = (LatentAttention(shape, layer, kernels) if shape.mla
                                     else Attention(shape, layer, kernels, rotary))
        self.mlp: nn.Module = SparseMoE(shape, plan.moe_path) if shape.moe is not None else GatedMLP(shape)
        self.post_norms = shape.post_norms
        if not self.post_norms:
            self.input_layernorm = norm()
        self.post_attention_layernorm = norm()  # Llama: before the MLP; sandwich and post: after attention
        self.sandwich = shape.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = norm()
        if self.sandwich or self.post_norms:
            self.post_feedforward_layernorm = norm()
        self.rope = shape.rope
        # a decode step's whole layer may run as one CPU op; it does where quantization packed the layer's linears
        # (the op checks per step that it applies: kernels/cpu/decode_layer.py)
        self.fused_decode = plan.fused_cpu_decode and shape.fusable
        self.fusable = shape.fusable

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend,
                meta: AttentionMetadata) -> torch.Tensor:
        if self.fused_decode:
            attn, mlp = self.self_attn, self.mlp
            out = fused_decode_layer(x, cos, sin, (self.input_layernorm, self.post_attention_layernorm),
                                     (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj), attn.num_heads,
                                     attn.layer, backend, meta)
            if out is not None:
                return out
        if self.post_norms:
            x = x + self.post_attention_layernorm(self.self_attn(x, cos, sin, backend, meta))
            return x + self.post_feedforward_layernorm(self.mlp(x))
        if not self.sandwich:
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, backend, meta)
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, backend, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
