"""The inference engine the scheduler drives: our Llama, a paged KV cache and continuous batching.

`Engine.from_source(source, EngineConfig())` loads a model; `add_request`, `abort`, `step` and `stats` are
the whole interface. Submodules import torch, so this package re-exports nothing eagerly.
"""
