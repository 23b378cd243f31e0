"""Quality cost of `--quantization int8`: greedy agreement with float32 over a fixed prompt set.

Runs the engine in-process twice on the same chat prompts (float32, then int8 weights) and reports, per
prompt, how many leading tokens agree and whether the whole greedy continuation is identical. The prompts run
as one batch, or with `--sequential` one at a time (batch-1 decode takes int8's single-row kernel).

    .venv/bin/python bench/int8_quality.py --max-tokens 64
"""

from __future__ import annotations

import argparse

import torch

from actors.common.model_source import DEFAULT_MODEL, resolve_model
from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from bus.messages import TokenizedRequest, SamplingParams

PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "List three colors.",
    "Explain photosynthesis in one sentence.", "What is 17 times 3?", "Name a famous physicist.",
    "Give me a synonym for happy.", "Translate 'good morning' to Spanish.", "What is a prime number?",
    "Describe a cat in five words.", "Why is the sky blue?", "Suggest a name for a pet goldfish.",
    "What does CPU stand for?", "Write a short greeting for a birthday card.", "How many legs does a spider have?",
    "What is the boiling point of water in Celsius?",
]


def generate(engine: Engine, prompts: list[list[int]], max_tokens: int, sequential: bool = False) -> list[list[int]]:
    """Greedy continuations of every prompt, batched as the server would run them (or one at a time)."""
    params = SamplingParams(max_tokens, temperature=0.0, stop_token_ids=[engine.tokenizer.eos_token_id])
    out: dict[str, list[int]] = {f"q{i}": [] for i in range(len(prompts))}
    for group in ([[i] for i in range(len(prompts))] if sequential else [list(range(len(prompts)))]):
        for i in group:
            engine.add_request(TokenizedRequest(f"q{i}", prompts[i], params))
        while engine.has_work():
            for row in engine.step():
                out[row.rid].extend(row.token_ids)
    return [out[f"q{i}"] for i in range(len(prompts))]


def main() -> None:
    """Print the agreement table and the summary line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--sequential", action="store_true",
                        help="run the prompts one at a time (batch-1 decode) instead of all together")
    args = parser.parse_args()
    source = resolve_model(args.model)
    results = {}
    for method in ("none", "int8"):
        engine = Engine.from_source(source, EngineConfig(device="cpu", dtype="float32", quantization=method,
                                                         max_total_tokens=16384))
        prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                        tokenize=True, return_dict=False) for p in PROMPTS]
        with torch.no_grad():
            results[method] = generate(engine, prompts, args.max_tokens, args.sequential)
    same, prefix_total, total = 0, 0, 0
    for prompt, exact, quant in zip(PROMPTS, results["none"], results["int8"]):
        prefix = next((i for i, (a, b) in enumerate(zip(exact, quant)) if a != b), min(len(exact), len(quant)))
        same += exact == quant
        prefix_total += prefix
        total += len(exact)
        print(f"{prefix:4d}/{len(exact):<4d} {'identical' if exact == quant else 'diverges'}  {prompt}")
    print(f"int8 vs float32 greedy: {same}/{len(PROMPTS)} continuations identical; "
          f"{prefix_total}/{total} tokens agree before the first divergence ({prefix_total / total:.0%})")


if __name__ == "__main__":
    main()
