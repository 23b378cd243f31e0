"""Device compute for the engine: attention backends over the paged KV pool, and token sampling.

Modules here import only torch: nothing in `kernels` knows about actors, the bus or transformers.
"""
