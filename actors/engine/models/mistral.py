"""Mistral: Llama's layer with a sliding attention window on every layer (`sliding_window`, when set)."""

from ringserve.actors.engine.models.spec import ArchSpec

SPEC = ArchSpec(name="mistral", gguf_permute_qk=True, fused_cpu_decode=True)
