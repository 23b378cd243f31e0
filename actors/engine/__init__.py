"""The inference engine the scheduler drives, by concern: `scheduling/` (the engine loop, continuous batching,
prefill and decode, the prefix cache), `runner/` (the forward pass, the paged KV pool, `runner/graphs/`),
`models/`, `quantization/` and `parallel/` (tensor parallelism).

`EngineCore.from_source(source, EngineConfig())` (`scheduling/engine_core.py`, `config.py`) loads a model;
`interface.EngineInterface` is everything the scheduler actor uses of it. Submodules import torch, so this
package re-exports nothing eagerly.
"""
