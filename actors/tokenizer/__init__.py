"""The tokenizer actor: chat template, tokenization and sampling-parameter validation."""
