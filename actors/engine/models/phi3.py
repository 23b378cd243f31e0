"""Phi-3 (and Phi-3.5/Phi-4-mini): Llama's layer whose checkpoints already fuse q/k/v (`qkv_proj`) and gate/up
(`gate_up_proj`), with partial rotary and `longrope` scaling where the config asks, and a sliding window when
`sliding_window` is set. llama.cpp names the fused tensors `attn_qkv` and `ffn_up`."""

from ringserve.actors.engine.models.spec import ArchSpec

SPEC = ArchSpec(name="phi3", hf_fusions={},
                gguf_linears={"self_attn.qkv_proj": ("attn_qkv",), "self_attn.o_proj": ("attn_output",),
                              "mlp.gate_up_proj": ("ffn_up",), "mlp.down_proj": ("ffn_down",)})
