"""OLMo 2 and OLMo 3: norms after attention and after the MLP only (`post_attention_layernorm`,
`post_feedforward_layernorm`; none before either), and an RMSNorm over the whole q and the whole k projection
(all heads at once) before the rotary embedding. OLMo 3 adds sliding-window layers (`layer_types`), each layer
type with rotary parameters of its own."""

from ringserve.actors.engine.models.spec import ArchSpec

SPEC = ArchSpec(name="olmo2", qk_norm=True, qk_norm_scope="projection", post_norms=True)
