"""A decoder-only language model built from the shared blocks as its family's `ArchSpec` declares, and the
interface the rest of the engine reaches every model through.

The runner, graphs, quantization and tensor-parallel code use only: `layer_attention()` (each layer's scale,
window and soft-cap, for the attention backend), `num_heads`/`num_kv_heads`/`head_dim` (this rank's, uniform
over layers), `latent_kv` (one latent per token instead of K and V), `num_layers`, `dtype`, `vocab_size`, `context_length`, `decoder_layers()` (each with `self_attn`
(`qkv_proj`, `o_proj`, head counts) and `mlp` (`gate_up_proj`, `down_proj`, `inner`), the pieces tensor
parallelism shards and quantization swaps), `execution` (the `ExecutionPlan` it was built with) and `forward`.
Nothing outside models/ names an architecture.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn

from ringserve.actors.common.model_catalog import context_length, family_of
from ringserve.actors.engine.core.embed_override import EmbedOverride
from ringserve.actors.engine.execution_plan import ExecutionPlan
from ringserve.actors.engine.models.blocks import make_norm
from ringserve.actors.engine.models.decoder_layer import DecoderLayer
from ringserve.actors.engine.models.mrope import mrope_tables
from ringserve.actors.engine.models.rope import RopeLengthRule, Rotary, rope_parameters, rotation
from ringserve.actors.engine.models.spec import ArchSpec, LayerShape, layer_shapes, spec_of
from ringserve.actors.engine.models.vision.span_attention import SpanAttention
from ringserve.kernels.attention import AttentionBackend, AttentionMetadata
from ringserve.kernels.attention.backend import LayerAttention

# the catalog's vision-language families -> the module (of this package) and class building them
VISION_MODELS = {"llava": ("vision.llava", "Llava"), "gemma3_vision": ("vision.gemma3", "Gemma3Vision"),
                 "qwen2_vl": ("vision.qwen2_vl", "Qwen2VL"), "qwen2_5_vl": ("vision.qwen2_vl", "Qwen2_5_VL")}


class DecoderStack(nn.Module):
    """Embeddings, decoder layers, final norm and the rotary tables (HF's `model.` prefix), built as `plan` says."""

    def __init__(self, config: Any, spec: ArchSpec, shapes: list[LayerShape], plan: ExecutionPlan) -> None:
        super().__init__()
        # No random init: every tensor is assigned from the checkpoint. On the meta device (where weights.py
        # builds the model) Embedding's normal_ alone imports ~900 modules: ~1.8 s of every start.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        max_positions = config.max_position_embeddings
        rotary = nn.ModuleDict({kind: Rotary(rope_parameters(config, None if kind == "default" else kind),
                                             shapes[0].rope_dim, max_positions)
                                for kind in sorted({s.rope for s in shapes})})
        # the Triton rotary kernel turns whole heads only (CausalLM.rotary_dim, head_dim)
        rotate = rotation(plan.norm_rotary_kernels, min(r.dim for r in rotary.values()) == shapes[0].head_dim)
        self.layers = nn.ModuleList(DecoderLayer(shape, i, plan, rotate) for i, shape in enumerate(shapes))
        self.norm = make_norm(config.hidden_size, config.rms_norm_eps, spec.norm_unit_offset, plan.norm_rotary_kernels)
        self.rotary = rotary


class CausalLM(nn.Module):
    """A decoder-only model with a language-model head; `forward` returns next-token logits of each request.
    `plan`: the execution choices it is built with (default: the torch kernels, no fused decode layer)."""

    def __init__(self, config: Any, spec: ArchSpec, plan: ExecutionPlan = ExecutionPlan()) -> None:
        super().__init__()
        self.config = config
        self.spec = spec
        # private: a stored decode graph is named by the modules' public attributes, and the layers hold what the
        # plan changes in them (graph_store.py), not the plan's runtime settings
        self._execution = plan
        shapes = layer_shapes(spec, config)
        self._attention = [s.attention for s in shapes]
        self.model = DecoderStack(config, spec, shapes, plan)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.embed_scale = config.hidden_size ** 0.5 if spec.embed_scale else None
        self.final_softcap = getattr(config, spec.final_softcap, None) if spec.final_softcap else None
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding matrix with the LM head when the config says so."""
        if self.tied_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def execution(self) -> ExecutionPlan:
        """The execution plan the model was built with (its norm and rotary kernels, fused decode layers, experts'
        path)."""
        return self._execution

    def decoder_layers(self) -> list[DecoderLayer]:
        """The decoder layers, in order."""
        return list(self.model.layers)

    def layer_attention(self) -> list[LayerAttention]:
        """How each layer attends (scale, sliding window, soft-cap), for the attention backend."""
        return list(self._attention)

    @property
    def num_layers(self) -> int:
        """Decoder layers."""
        return len(self.model.layers)

    @property
    def num_heads(self) -> int:
        """Query heads per layer on this rank (a tensor-parallel shard keeps 1/tp of them)."""
        return self.model.layers[0].self_attn.num_heads

    @property
    def num_kv_heads(self) -> int:
        """KV heads per layer on this rank."""
        return self.model.layers[0].self_attn.num_kv_heads

    @property
    def head_dim(self) -> int:
        """Per-head dimension of queries, keys and values."""
        return self.model.layers[0].self_attn.head_dim

    @property
    def latent_kv(self) -> bool:
        """Whether the KV pool holds one latent per token and layer, its values the keys' leading part (latent
        attention, models/mla.py), instead of keys and values apart."""
        return bool(self.model.layers[0].self_attn.latent_kv)

    @property
    def rotary_dim(self) -> int:
        """How many dims of each head the rotary embedding turns (all of them unless partial)."""
        return min(rotary.dim for rotary in self.model.rotary.values())

    @property
    def rope_length_rule(self) -> RopeLengthRule | None:
        """How the rotary depends on the sequence's length (`dynamic`, `longrope`); None for every other model,
        whose forward then takes no `rope_lengths`."""
        rules = {rotary.length_rule for rotary in self.model.rotary.values()} - {None}
        if len(rules) > 1:
            raise ValueError(f"layer types with different length-dependent rotaries: {sorted(map(str, rules))}")
        return next(iter(rules), None)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype activations and the KV cache are kept in."""
        return self.model.embed_tokens.weight.dtype

    @property
    def vocab_size(self) -> int:
        """Rows of the LM head."""
        return self.config.vocab_size

    @property
    def context_length(self) -> int:
        """The longest sequence the model takes (its config's max_position_embeddings, or further with `dynamic`
        rotary scaling)."""
        return context_length(self.config)

    @property
    def tied_embeddings(self) -> bool:
        """Whether the LM head is the embedding matrix."""
        return bool(getattr(self.config, "tie_word_embeddings", False))

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend,
                meta: AttentionMetadata, logits_index: torch.Tensor,
                hidden_index: torch.Tensor | None = None,
                override: EmbedOverride | None = None,
                rope_lengths: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`input_ids`, `positions` `[T]` -> logits `[S, V]` at the `S` token indices in `logits_index`; with
        `hidden_index`, also the final-norm hidden states `[H, C]` at those `H` indices (embeddings: the state
        the LM head reads, before any logit soft-cap). `override`: image embeddings in place of some tokens'.
        `rope_lengths` `[T]`: the sequence length each token is rotated for (`rope_length_rule`; default its
        position + 1)."""
        if override is not None:  # an image token id may lie past the embedding matrix (Gemma 3's may)
            input_ids = input_ids.index_fill(0, override.index, 0)
        x = self.model.embed_tokens(input_ids)  # [T, C]
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        if override is not None:
            x = x.index_copy(0, override.index, override.embeds.to(x.dtype))
            if override.spans:
                backend = SpanAttention(backend, override.spans)  # type: ignore[assignment]
        tables = {kind: rotary(positions, x.dtype, rope_lengths) for kind, rotary in self.model.rotary.items()}
        if override is not None and override.rope_positions is not None:
            tables = mrope_tables(self.model.rotary, tables, override.index, override.rope_positions)
        for layer in self.model.layers:
            cos, sin = tables[layer.rope]
            x = layer(x, cos, sin, backend, meta)
        hidden = None if hidden_index is None else self.model.norm(x[hidden_index])  # [H, C]
        x = self.model.norm(x[logits_index])  # [S, C]; the norm is per row, so select first
        logits = self.lm_head(x)  # [S, V]
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits if hidden is None else (logits, hidden)


def build_model(config: Any, plan: ExecutionPlan = ExecutionPlan()) -> Any:
    """Our model for `config` (a `CausalLM`; a vision-language checkpoint's a `VisionCausalLM` of its text
    family), built on the current default device with `plan`'s execution choices."""
    family = family_of(config)
    if family in VISION_MODELS:
        module, name = VISION_MODELS[family]
        text_spec = spec_of(family_of(config.text_config))
        return getattr(importlib.import_module(f"{__package__}.{module}"), name)(config, text_spec, plan)
    return CausalLM(config, spec_of(family), plan)
