"""Reasoning, tool calls and grammars (structured output) at every layer: kernels, engine, tokenizer, detokenizer,
routes."""
