"""The inference engine the scheduler drives: our Llama, a paged KV cache and continuous batching.

`Engine.from_source(source, EngineConfig())` loads a model; `interface.EngineInterface` is everything the
scheduler actor uses of it. Submodules import torch, so this package re-exports nothing eagerly.
"""
