"""Device compute for the engine: attention backends over the paged KV pool, token sampling, and grammar
masks for constrained decoding.

Nothing in `kernels` knows about actors or the bus. Modules import torch; the optional packages (triton,
flashinfer, xgrammar) are imported only by the backend modules that need them, when such a backend is made.
"""
