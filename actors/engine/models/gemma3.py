"""Gemma 3 (text): Gemma 2's layer with q/k norms instead of attention soft-capping, five sliding-window layers to
each global one, and a rotary base per layer type (`rope_parameters['sliding_attention' | 'full_attention']`)."""

from ringserve.actors.engine.models.spec import ArchSpec

SPEC = ArchSpec(name="gemma3", qk_norm=True, norm_unit_offset=True, sandwich_norms=True, embed_scale=True,
                query_pre_attn_scalar=True, attn_softcap="attn_logit_softcapping",
                final_softcap="final_logit_softcapping", activation_field="hidden_activation")
