"""What an architecture family declares (`ArchSpec`), and each layer's shape derived from it and a config.

A family file (models/llama.py, qwen3.py, gemma3.py, ...) holds one `ArchSpec` (the checkpoint names that lead
to it are in models/registry.py): which optional pieces of the shared blocks it uses
(q/k/v bias, q/k norm, Gemma's `1 + weight` norms and sandwich norms, embedding scale, logit soft-caps, sliding
windows, partial rotary, activation), how its checkpoint's tensors map onto ours (fusions, GGUF names) and whether
the fused CPU decode-layer op may run its layers. `layer_shapes(spec, config)` resolves all of it per layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ringserve.kernels.attention.backend import LayerAttention

# our fused linear -> the HF checkpoint tensors it is made of (row order), for families whose checkpoints keep
# them apart
HF_FUSIONS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
              "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
# our linear -> the GGUF tensors (suffixes of `blk.{i}.`) it is made of, in row order (llama.cpp's names)
GGUF_LINEARS = {"self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"), "self_attn.o_proj": ("attn_output",),
                "mlp.gate_up_proj": ("ffn_gate", "ffn_up"), "mlp.down_proj": ("ffn_down",)}


def _config_flag(name: str) -> Callable[[Any], bool]:
    return lambda config: bool(getattr(config, name, False))


@dataclass(frozen=True)
class ArchSpec:
    """One architecture family: what it serves and which pieces of the shared blocks it uses."""

    name: str
    qkv_bias: Callable[[Any], bool] = _config_flag("attention_bias")
    o_bias: Callable[[Any], bool] = _config_flag("attention_bias")
    mlp_bias: Callable[[Any], bool] = _config_flag("mlp_bias")
    qk_norm: bool = False
    norm_unit_offset: bool = False  # Gemma's RMSNorm scales by (1 + weight)
    sandwich_norms: bool = False  # Gemma 2/3: a norm after attention and after the MLP too
    embed_scale: bool = False  # Gemma: embeddings times sqrt(hidden_size)
    query_pre_attn_scalar: bool = False  # Gemma: softmax scale query_pre_attn_scalar ** -0.5, not head_dim's
    attn_softcap: str | None = None  # config field of the attention logits' soft-cap
    final_softcap: str | None = None  # config field of the final logits' soft-cap
    activation_field: str = "hidden_act"
    hf_fusions: dict[str, tuple[str, ...]] = field(default_factory=lambda: dict(HF_FUSIONS))
    gguf_linears: dict[str, tuple[str, ...]] = field(default_factory=lambda: dict(GGUF_LINEARS))
    gguf_permute_qk: bool = False  # llama.cpp's converter permutes q/k rows for Llama's rotary layout
    fused_cpu_decode: bool = False  # the C++ decode-layer op (kernels/cpu/decode_layer.cpp) runs Llama's layer

    def activation(self, config: Any) -> str:
        """The MLP's activation function's name."""
        return getattr(config, self.activation_field, None) or getattr(config, "hidden_activation", None) or "silu"


@dataclass(frozen=True)
class LayerShape:
    """Everything the blocks need to build one decoder layer."""

    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float
    activation: str
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    norm_unit_offset: bool
    sandwich_norms: bool
    rope: str  # the layer type whose rotary parameters this layer uses
    attention: LayerAttention
    fusable: bool  # whether the fused CPU decode-layer op computes this layer


def head_dim_of(config: Any) -> int:
    """Per-head dimension: `config.head_dim` when set, else hidden size / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_type(config: Any, layer: int) -> str:
    """`sliding_attention` or `full_attention`: from `layer_types` when the config has them, else every layer
    slides when `sliding_window` is set (Mistral, Phi-3)."""
    types = getattr(config, "layer_types", None)
    if types:
        return types[layer]
    return "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"


def layer_shapes(spec: ArchSpec, config: Any) -> list[LayerShape]:
    """Each decoder layer's `LayerShape` under `spec` for `config`."""
    head_dim = head_dim_of(config)
    scale = (config.query_pre_attn_scalar ** -0.5) if spec.query_pre_attn_scalar else head_dim ** -0.5
    softcap = getattr(config, spec.attn_softcap, None) if spec.attn_softcap else None
    activation = spec.activation(config)
    per_type_rope = isinstance(getattr(config, "rope_parameters", None), dict) and any(
        isinstance(v, dict) for v in config.rope_parameters.values())
    shapes = []
    for i in range(config.num_hidden_layers):
        kind = layer_type(config, i)
        window = config.sliding_window if kind == "sliding_attention" else None
        attention = LayerAttention(scale, window, softcap)
        shapes.append(LayerShape(
            hidden=config.hidden_size, intermediate=config.intermediate_size,
            num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads, head_dim=head_dim,
            norm_eps=config.rms_norm_eps, activation=activation, qkv_bias=spec.qkv_bias(config),
            o_bias=spec.o_bias(config), mlp_bias=spec.mlp_bias(config), qk_norm=spec.qk_norm,
            norm_unit_offset=spec.norm_unit_offset, sandwich_norms=spec.sandwich_norms,
            rope=kind if per_type_rope else "default", attention=attention,
            fusable=spec.fused_cpu_decode and activation == "silu"))
    return shapes
