"""A tiny Qwen3-style reasoning model for tests: SmolLM2's tokenizer with `<think>` and `</think>` added as
Qwen3 adds them (plain added tokens, not special), the Qwen3-style chat template of tests/chat_templates/qwen3.jinja
(its `enable_thinking` switch), random tiny Llama weights and, if given, a generation_config.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

QWEN3_TEMPLATE = Path(__file__).parent / "chat_templates" / "qwen3.jinja"
THINK_TOKENS = ["<think>", "</think>"]
VOCAB = 49216  # SmolLM2's 49152 and the added tokens, padded to a multiple of 64 as Qwen pads its vocabulary


def save_reasoning_model(directory: Path, context_length: int = 4096, template: str | None = None,
                         generation_config: dict[str, Any] | None = None, weights: bool = True,
                         special_tokens: list[str] | None = None) -> Path:
    """Save the model into `directory` (`template`: its chat template, default the Qwen3-style one; `weights`:
    False saves only config.json and the tokenizer, enough for the tokenizer actor; `special_tokens`: more
    tokens to add, as special ones, e.g. gpt-oss's harmony markers)."""
    from transformers import LlamaConfig

    from ringserve.actors.common.model_source import load_tokenizer, resolve_model

    directory.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context_length,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    if weights:
        import torch
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(directory)
    else:
        config.save_pretrained(directory)
    tokenizer = load_tokenizer(resolve_model("SmolLM2-135M-Instruct"))
    tokenizer.add_tokens(THINK_TOKENS)
    if special_tokens:
        tokenizer.add_special_tokens({"additional_special_tokens": special_tokens})
    tokenizer.chat_template = template if template is not None else QWEN3_TEMPLATE.read_text()
    tokenizer.save_pretrained(directory)
    if generation_config is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation_config))
    return directory
