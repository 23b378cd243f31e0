"""Gemma 2: `1 + weight` RMSNorms around both sublayers, embeddings scaled by sqrt(hidden), GeGLU, softmax scale
`query_pre_attn_scalar ** -0.5`, attention and final logit soft-capping, sliding and global layers alternating."""

from ringserve.actors.engine.models.spec import ArchSpec

SPEC = ArchSpec(name="gemma2", norm_unit_offset=True, sandwich_norms=True, embed_scale=True,
                query_pre_attn_scalar=True, attn_softcap="attn_logit_softcapping",
                final_softcap="final_logit_softcapping", activation_field="hidden_activation")
