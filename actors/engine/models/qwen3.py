"""Qwen3: Llama's layer with an RMSNorm over each head's queries and keys before the rotary embedding."""

from ringserve.actors.engine.models.spec import ArchSpec

SPEC = ArchSpec(name="qwen3", qk_norm=True)
