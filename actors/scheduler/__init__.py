"""The scheduler actor: owns requests and the KV cache, drives the engine one step at a time."""
