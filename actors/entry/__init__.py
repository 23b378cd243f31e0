"""The entry actor: OpenAI-compatible and native HTTP API in front of the ring."""
