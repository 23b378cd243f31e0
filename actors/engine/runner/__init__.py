"""The model runner: one forward pass over a batch (`model_runner.ModelRunner`), the token table and the paged
KV pool; `graphs/` holds the compiled decode graphs that replay a step."""
