"""Quality cost of each quantized kernel: greedy agreement with float32 over a fixed prompt set.

Runs the engine in-process on the same chat prompts, first in float32, then once per quantized kernel applied
to every linear at every batch size (`q8_0` and `q4_1`/`q4_0`, our group kernels, which `--quantization int8`
and `int4` run; `int_mm`, the per-row int8 path; `gguf`, the GGUF file's own blocks as `--quantization gguf`
runs them; the 4-bit kernels keep the LM head at `q8_0`, as `int4` does, unless `--head-too`), and reports, per prompt, how many leading tokens agree and
whether the whole greedy continuation is identical. A server's per-host plan runs float32 at the step sizes
where a kernel is slower, which can only agree more. The prompts run as one batch, or with `--sequential` one
at a time (batch-1 decode).

    .venv/bin/python bench/int8_quality.py --max-tokens 64 [--kernels q8_0 q4_1 int_mm gguf] [--verbose]
"""

from __future__ import annotations

import argparse

import torch

from ringserve.actors.common.model_source import DEFAULT_MODEL, resolve_model
from ringserve.actors.engine.config import EngineConfig
from ringserve.actors.engine.scheduling.engine_core import EngineCore
from ringserve.actors.engine.models.gguf_blocks import load_packed_linears
from ringserve.bus.messages import TokenizedRequest, SamplingParams
from ringserve.kernels.linear_plan.planner import linear_shapes
from ringserve.kernels.quantization import quantize_linears

METHOD_OF = {"q8_0": "int8", "int_mm": "int8", "q4_1": "int4", "q4_0": "int4", "gguf": "gguf"}

PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "List three colors.",
    "Explain photosynthesis in one sentence.", "What is 17 times 3?", "Name a famous physicist.",
    "Give me a synonym for happy.", "Translate 'good morning' to Spanish.", "What is a prime number?",
    "Describe a cat in five words.", "Why is the sky blue?", "Suggest a name for a pet goldfish.",
    "What does CPU stand for?", "Write a short greeting for a birthday card.", "How many legs does a spider have?",
    "What is the boiling point of water in Celsius?",
]


def generate(engine: EngineCore, prompts: list[list[int]], max_tokens: int, sequential: bool = False) -> list[list[int]]:
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


def agreement(exact: list[list[int]], quant: list[list[int]], verbose: bool) -> tuple[int, int, int]:
    """(identical continuations, tokens agreeing before the first divergence, tokens), printing each prompt's."""
    same, prefix_total, total = 0, 0, 0
    for prompt, a, b in zip(PROMPTS, exact, quant):
        prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        same += a == b
        prefix_total += prefix
        total += len(a)
        if verbose:
            print(f"{prefix:4d}/{len(a):<4d} {'identical' if a == b else 'diverges'}  {prompt}")
    return same, prefix_total, total


def main() -> None:
    """Print one summary line per kernel (and with --verbose its per-prompt table)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--kernels", nargs="+", default=["q8_0", "q4_1", "q4_0", "int_mm", "gguf"],
                        choices=list(METHOD_OF))
    parser.add_argument("--sequential", action="store_true",
                        help="run the prompts one at a time (batch-1 decode) instead of all together")
    parser.add_argument("--verbose", action="store_true", help="print every prompt's agreement")
    parser.add_argument("--head-too", action="store_true", help="4-bit kernels quantize the LM head to 4 bits too")
    args = parser.parse_args()
    source = resolve_model(args.model)
    exact: list[list[int]] = []
    for kernel in ["none", *args.kernels]:
        engine = EngineCore.from_source(source, EngineConfig(device="cpu", dtype="float32", max_total_tokens=16384))
        if kernel == "gguf":  # every linear on its file's own blocks, at every batch size
            model = engine.runner.model
            packed = load_packed_linears(source, model.config.num_hidden_layers, model.config.tie_word_embeddings)
            quantize_linears(model, "gguf", {(p.out_features, p.in_features): {1: p.format} for p in packed.values()},
                             packed)
        elif kernel != "none":
            model = engine.runner.model
            plan = {shape: {1: kernel} for shape in linear_shapes(model)}
            head = model.lm_head
            if METHOD_OF[kernel] == "int4" and not args.head_too:
                plan[(head.out_features, head.in_features)] = {1: "q8_0"}
            quantize_linears(model, METHOD_OF[kernel], plan)
        prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                        tokenize=True, return_dict=False) for p in PROMPTS]
        with torch.no_grad():
            out = generate(engine, prompts, args.max_tokens, args.sequential)
        if kernel == "none":
            exact = out
            continue
        same, prefix_total, total = agreement(exact, out, args.verbose)
        head = " (4-bit head)" if args.head_too and METHOD_OF[kernel] == "int4" else ""
        print(f"{kernel}{head} vs float32 greedy: {same}/{len(PROMPTS)} continuations identical; "
              f"{prefix_total}/{total} tokens agree before the first divergence ({prefix_total / total:.0%})",
              flush=True)


if __name__ == "__main__":
    main()
