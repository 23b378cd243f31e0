"""Llama 1/2/3.x (and SmolLM2): the plain pre-norm SwiGLU decoder every other family varies.

Rotary scaling comes from the config (`llama3`, `linear`, `dynamic`, `yarn`: models/rope.py). llama.cpp's
converter permutes the q/k rows of a Llama GGUF for its rotary layout, which its blocks are read back through.
The fused CPU decode-layer op (kernels/cpu/decode_layer.cpp) computes this layer.
"""

from ringserve.actors.engine.models.spec import ArchSpec

SPEC = ArchSpec(name="llama", gguf_permute_qk=True, fused_cpu_decode=True)
