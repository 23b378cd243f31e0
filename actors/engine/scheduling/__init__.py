"""Scheduling: the engine loop (`engine_core.EngineCore`), which requests prefill or decode each step (prefill and decode
managers, chunking), requests and batches, stop rules, output constraints (grammar, jump-forward), the KV cache
manager and the prefix cache."""
