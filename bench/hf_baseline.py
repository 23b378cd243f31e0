"""The transformers baseline: the same prompts through `generate` on this machine, static batches of N.

For concurrency level N the level's requests run as consecutive static batches of N (left padding, greedy,
`min_new_tokens = max_new_tokens` so every row makes exactly as many tokens as the server's `ignore_eos`
requests); level 1 is plain one-prompt-at-a-time `generate`. torch uses every core unless told otherwise.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch


def encode_conversations(tokenizer: Any, conversations: list[list[dict[str, str]]]) -> list[list[int]]:
    """Token ids of each conversation exactly as ringserve's tokenizer actor makes them (chat template)."""
    ids = []
    for messages in conversations:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids.append(tokenizer.encode(text, add_special_tokens=False))
    return ids


def load_hf(model_spec: str) -> tuple[Any, Any]:
    """The model (float32, eval) and tokenizer that ringserve serves for `model_spec`, via transformers."""
    from transformers import AutoModelForCausalLM

    from ringserve.actors.common.model_source import load_tokenizer, resolve_model

    source = resolve_model(model_spec)
    model = AutoModelForCausalLM.from_pretrained(source.directory, dtype=torch.float32, **source.hf_kwargs())
    return model.eval(), load_tokenizer(source)


@torch.no_grad()
def generate_batch(model: Any, batch: list[list[int]], max_tokens: int, pad_id: int) -> int:
    """Greedy `generate` of exactly `max_tokens` new tokens for every (left-padded) prompt; tokens made."""
    width = max(len(ids) for ids in batch)
    input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids in batch])
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch])
    out = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=max_tokens,
                         min_new_tokens=max_tokens, pad_token_id=pad_id, temperature=None, top_p=None,
                         top_k=None)
    return int((out.shape[1] - width) * out.shape[0])


def run_hf_baseline(model_spec: str, level_conversations: dict[int, list[list[dict[str, str]]]],
                    max_tokens: int, threads: int = 0) -> dict[int, dict[str, float]]:
    """For each concurrency level N: its conversations in static batches of N; tok/s and seconds per level.

    `threads` is torch's thread count (0 = one per core).
    """
    torch.set_num_threads(threads or os.cpu_count() or 1)
    model, tokenizer = load_hf(model_spec)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    generate_batch(model, encode_conversations(tokenizer, [[{"role": "user", "content": "Hi"}]]), 4, pad_id)
    results: dict[int, dict[str, float]] = {}
    for level, conversations in level_conversations.items():
        prompts = encode_conversations(tokenizer, conversations)
        start, tokens = time.perf_counter(), 0
        for i in range(0, len(prompts), level):
            tokens += generate_batch(model, prompts[i:i + level], max_tokens, pad_id)
        seconds = time.perf_counter() - start
        results[level] = {"output_tok_s": tokens / seconds, "seconds": seconds, "tokens": tokens,
                          "requests": len(prompts), "batch_size": level}
        print(f"  transformers batch {level:>3}: {tokens / seconds:7.1f} tok/s ({len(prompts)} prompts, "
              f"{seconds:.1f} s)", flush=True)
    del model
    return results
