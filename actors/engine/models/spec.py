"""What an architecture family declares (`ArchSpec`), and each layer's shape derived from it and a config.

A family file (models/llama.py, qwen3.py, gemma3.py, ...) holds one `ArchSpec`, loaded by `spec_of(family)` (the
checkpoint names that lead to a family are in the model catalog, actors/common/model_catalog.py): which optional
pieces of the shared blocks it uses (q/k/v bias, q/k norm, Gemma's `1 + weight` norms and sandwich norms,
embedding scale, logit soft-caps, sliding windows, partial rotary, activation), which layers are
mixture-of-experts (`MoESpec`) and whether attention is DeepSeek's latent attention (`mla`), how its
checkpoint's tensors map onto ours (renames, fusions, GGUF names) and whether the fused CPU decode-layer op may
run its layers. `layer_shapes(spec, config)` resolves all of it per layer.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from ringserve.actors.common.model_catalog import FAMILIES, VISION_FAMILIES, UnsupportedArchitecture
from ringserve.kernels.attention.backend import LayerAttention

# our fused linear -> the HF checkpoint linears it is made of (row order), siblings under one parent module (an
# attention, an MLP, each expert), for families whose checkpoints keep them apart
HF_FUSIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# our linear -> the GGUF tensors (suffixes of `blk.{i}.`) it is made of, in row order (llama.cpp's names)
GGUF_LINEARS = {"self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"), "self_attn.o_proj": ("attn_output",),
                "mlp.gate_up_proj": ("ffn_gate", "ffn_up"), "mlp.down_proj": ("ffn_down",)}


def config_value(config: Any, *names: str) -> Any:
    """The first of `names` the config sets: transformers serialises some fields under an alias (Qwen3-MoE's
    `num_experts` is `num_local_experts` in its resolved JSON), and our resolved configs are plain namespaces."""
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    raise AttributeError(f"config has none of {', '.join(names)}")


def _config_flag(name: str) -> Callable[[Any], bool]:
    return lambda config: bool(getattr(config, name, False))


@dataclass(frozen=True)
class MoESpec:
    """A family's mixture-of-experts layers (models/moe.py): which layers, how the router scores and picks
    experts, and the shared experts. Each field reads the family's own config names."""

    num_experts: Callable[[Any], int]  # routed experts
    inner: Callable[[Any], int]  # each expert's intermediate size
    is_sparse: Callable[[Any, int], bool]  # whether layer i is MoE (else a dense GatedMLP of intermediate_size)
    scoring: str = "softmax"  # "softmax" (Mixtral, Qwen, DeepSeek-V2) or "sigmoid" (DeepSeek-V3)
    renormalize: Callable[[Any], bool] = lambda config: True  # top-k weights divided by their sum
    # expert groups (DeepSeek): "max" (V2's group_limited_greedy: a group's best score), "top2" (V3: its best two
    # summed); None: plain top-k
    group_score: Callable[[Any], str | None] = lambda config: None
    routed_scale: Callable[[Any], float] = lambda config: 1.0  # routed_scaling_factor
    score_bias: bool = False  # V3's e_score_correction_bias, added for the choice only
    shared_inner: Callable[[Any], int] = lambda config: 0  # the shared experts' intermediate size (0: none)
    shared_gate: bool = False  # Qwen2-MoE: the shared expert's output times sigmoid(gate(x))


@dataclass(frozen=True)
class ArchSpec:
    """One architecture family: what it serves and which pieces of the shared blocks it uses."""

    name: str
    qkv_bias: Callable[[Any], bool] = _config_flag("attention_bias")
    o_bias: Callable[[Any], bool] = _config_flag("attention_bias")
    mlp_bias: Callable[[Any], bool] = _config_flag("mlp_bias")
    qk_norm: bool | Callable[[Any], bool] = False  # or read from the config (GLM-4.5's `use_qk_norm`)
    # what a q/k norm spans: "head" (each head's D dims: Qwen3, Gemma 3) or "projection" (all heads' dims of the
    # q and the k projection at once: OLMo 2/3)
    qk_norm_scope: str = "head"
    norm_unit_offset: bool = False  # Gemma's RMSNorm scales by (1 + weight)
    sandwich_norms: bool = False  # Gemma 2/3: a norm after attention and after the MLP too
    post_norms: bool = False  # OLMo 2/3, EXAONE 4: norms after attention and after the MLP only (none before)
    # whether layer i rotates its queries and keys (False: a NoPE layer, as SmolLM3's every fourth)
    rotary_layer: Callable[[Any, int], bool] = lambda config, layer: True
    embed_scale: bool = False  # Gemma: embeddings times sqrt(hidden_size)
    query_pre_attn_scalar: bool = False  # Gemma: softmax scale query_pre_attn_scalar ** -0.5, not head_dim's
    attn_softcap: str | None = None  # config field of the attention logits' soft-cap
    final_softcap: str | None = None  # config field of the final logits' soft-cap
    activation_field: str = "hidden_act"
    hf_fusions: dict[str, tuple[str, ...]] = field(default_factory=lambda: dict(HF_FUSIONS))
    gguf_linears: dict[str, tuple[str, ...]] = field(default_factory=lambda: dict(GGUF_LINEARS))
    gguf_permute_qk: bool = False  # llama.cpp's converter permutes q/k rows for Llama's rotary layout
    fused_cpu_decode: bool = False  # the C++ decode-layer op (kernels/cpu/decode_layer.cpp) runs Llama's layer
    moe: MoESpec | None = None  # mixture-of-experts layers, where the family has them
    mla: bool = False  # DeepSeek's multi-head latent attention (models/mla.py) instead of `Attention`
    # checkpoint name -> ours, regex substitutions applied before the fusions (Mixtral's `block_sparse_moe.w1`)
    hf_renames: tuple[tuple[str, str], ...] = ()
    # a last change to the checkpoint's tensors (in our names) and the config: DeepSeek's rope rows reordered
    prepare_weights: Callable[[Any, Any], Any] | None = None

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
    rotary: bool = True  # False: a NoPE layer (queries and keys not rotated)
    qk_norm_scope: str = "head"  # "head" or "projection" (ArchSpec.qk_norm_scope)
    post_norms: bool = False  # norms after each sublayer only (ArchSpec.post_norms)
    rope_dim: int = 0  # the per-head dimension the rotary tables are built for (head_dim; MLA's qk_rope_head_dim)
    moe: MoEShape | None = None  # this layer's experts, when it is a mixture-of-experts layer
    mla: bool = False  # latent attention (models/mla.py reads its own sizes from `config`)
    config: Any = None  # the model config, for blocks with sizes of their own (latent attention)


@dataclass(frozen=True)
class MoEShape:
    """One mixture-of-experts layer: its experts and router as `MoESpec` resolves them for a config."""

    num_experts: int
    top_k: int
    inner: int
    scoring: str
    renormalize: bool
    group_score: str | None
    num_groups: int
    top_groups: int
    routed_scale: float
    score_bias: bool
    shared_inner: int
    shared_gate: bool


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
    qk_norm = spec.qk_norm(config) if callable(spec.qk_norm) else spec.qk_norm
    shapes = []
    for i in range(config.num_hidden_layers):
        kind = layer_type(config, i)
        rotary = spec.rotary_layer(config, i)
        window = config.sliding_window if kind == "sliding_attention" else None
        attention = LayerAttention(scale, window, softcap)
        moe = _moe_shape(spec.moe, config) if spec.moe is not None and spec.moe.is_sparse(config, i) else None
        if spec.mla:  # DeepSeek: q·k over nope + rope dims, scaled as transformers' yarn_apply_mscale does
            attention = LayerAttention(_mla_scale(config), None, None)
        shapes.append(LayerShape(
            hidden=config.hidden_size, intermediate=config.intermediate_size,
            num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads, head_dim=head_dim,
            norm_eps=config.rms_norm_eps, activation=activation, qkv_bias=spec.qkv_bias(config),
            o_bias=spec.o_bias(config), mlp_bias=spec.mlp_bias(config), qk_norm=qk_norm,
            norm_unit_offset=spec.norm_unit_offset, sandwich_norms=spec.sandwich_norms,
            rope=kind if per_type_rope else "default", rotary=rotary, qk_norm_scope=spec.qk_norm_scope,
            post_norms=spec.post_norms, attention=attention,
            fusable=spec.fused_cpu_decode and activation == "silu" and moe is None and not spec.mla and rotary,
            rope_dim=config.qk_rope_head_dim if spec.mla else head_dim, moe=moe, mla=spec.mla, config=config))
    return shapes


def _moe_shape(spec: MoESpec, config: Any) -> MoEShape:
    groups = spec.group_score(config)
    return MoEShape(
        num_experts=spec.num_experts(config), top_k=config.num_experts_per_tok, inner=spec.inner(config),
        scoring=spec.scoring, renormalize=spec.renormalize(config), group_score=groups,
        num_groups=(getattr(config, "n_group", None) or 1) if groups else 1,
        top_groups=(getattr(config, "topk_group", None) or 1) if groups else 1, routed_scale=spec.routed_scale(config),
        score_bias=spec.score_bias, shared_inner=spec.shared_inner(config), shared_gate=spec.shared_gate)


def _mla_scale(config: Any) -> float:
    """Latent attention's softmax scale: 1/sqrt(nope + rope dims), times yarn's mscale(factor, mscale_all_dim)²
    when the rotary embedding is yarn-scaled (transformers' `yarn_apply_mscale`)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if params.get("rope_type", params.get("type", "default")) != "default" and params.get("mscale_all_dim"):
        factor, mscale_all_dim = params["factor"], params["mscale_all_dim"]
        mscale = 1.0 if factor <= 1 else 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def spec_of(family: str) -> ArchSpec:
    """The family's `ArchSpec` (its module imported now); a vision-language family's is its text model's, known
    from a config only (`causal_lm.build_model`)."""
    if family in VISION_FAMILIES:
        raise UnsupportedArchitecture(f"{family} is a vision-language family: its text_config names its text family")
    if family not in FAMILIES:
        raise UnsupportedArchitecture(f"no model family {family!r}; there are: {', '.join(FAMILIES)}")
    return importlib.import_module(f"{__package__}.{family}").SPEC
