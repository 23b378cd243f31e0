"""Qwen2 and Qwen2.5: Llama's layer with a bias on the q/k/v projections (none on o_proj or the MLP)."""

from ringserve.actors.engine.models.spec import ArchSpec

SPEC = ArchSpec(name="qwen2", qkv_bias=lambda config: True, o_bias=lambda config: False)
