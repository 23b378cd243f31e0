"""Does speculative decoding pay here? Two engines in one process, speculation off and `ngram`, on two workloads.

    .venv/bin/python bench/bench_speculative.py [--quantization gguf] [--streams 1,8] [--tokens 128]

The engines are built as the server builds them (compiled decode graphs, for 1..8 rows, compiled before timing;
a request verifying k drafts is k + 1 rows of a decode step, so verify steps run the same graphs). Workloads, greedy: "quote" asks for code or a list the
prompt holds to be copied or reworked (answers repeat the prompt: drafts hit), "prose" asks for open text.
For each workload and stream count both engines generate the same requests, one engine after the other, three
times alternating; prints the median tokens per second of each and the ratio, with the date and CPU, and the
speculating engine's acceptance. Figures hold only as ratios measured side by side in one run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_moe import cpu_name  # noqa: E402

CODE = ("def parse_header(line):\n    key, _, value = line.partition(':')\n    return key.strip().lower(), "
        "value.strip()\n\n\ndef parse_headers(lines):\n    headers = {}\n    for line in lines:\n        if not line:"
        "\n            break\n        key, value = parse_header(line)\n        headers[key] = value\n    return headers\n")
WORKLOADS = {
    "quote": [f"Rename the function parse_header to read_header everywhere in this code and show the whole code:"
              f"\n\n{CODE}",
              f"Copy this code exactly and add a docstring to each function:\n\n{CODE}",
              "Repeat this list exactly, one item per line: apples, pears, plums, cherries, grapes, lemons, limes, "
              "oranges, peaches, apricots, figs, dates, kiwis, mangoes",
              f"Add type hints to this code and show all of it:\n\n{CODE}"],
    "prose": ["Write a short story about a lighthouse keeper.", "Explain how bread rises, in a few paragraphs.",
              "Describe a walk through a forest in autumn.", "Write a letter to a friend about a trip to the sea."],
}


def build(model: str, quantization: str, algorithm: str, draft_tokens: int) -> object:
    from ringserve.actors.common.model_source import resolve_model
    from ringserve.actors.engine.config import EngineConfig
    from ringserve.actors.engine.scheduling.engine_core import EngineCore

    config = EngineConfig(device="cpu", quantization=quantization, cuda_graph_max_bs=8, max_running_requests=8,
                          max_total_tokens=16384, torch_threads=torch.get_num_threads(),
                          speculative_algorithm=algorithm, speculative_num_draft_tokens=draft_tokens)
    engine = EngineCore.from_source(resolve_model(model), config)
    graphs = engine.runner.graphs  # type: ignore[attr-defined]
    if graphs is not None and graphs.compiler is not None:
        graphs.compiler.choose = False
        for size in sorted({graphs.padded_size(b) for b in range(1, 9)}):
            graphs.compiler.request((size, torch.get_num_threads()))
            graphs.compiler.wait((size, torch.get_num_threads()), 1800)
    return engine


def run_once(engine: object, prompts: list[list[int]], tokens: int, tag: str) -> float:
    """Generated tokens per second for `prompts` at once."""
    from ringserve.bus.messages import SamplingParams, TokenizedRequest

    for i, ids in enumerate(prompts):
        engine.add_request(TokenizedRequest(f"{tag}-{i}", ids, SamplingParams(  # type: ignore[attr-defined]
            max_new_tokens=tokens, temperature=0.0)))
    started, generated = time.perf_counter(), 0
    while engine.has_work():  # type: ignore[attr-defined]
        generated += sum(len(row.token_ids) for row in engine.step())  # type: ignore[attr-defined]
    return generated / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--quantization", default="gguf")
    parser.add_argument("--streams", default="1,8")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--draft-tokens", type=int, default=3, help="--speculative-num-draft-tokens")
    args = parser.parse_args()
    engines = {name: build(args.model, args.quantization, name, args.draft_tokens) for name in ("none", "ngram")}
    tokenizer = engines["none"].tokenizer  # type: ignore[attr-defined]
    print(f"{date.today()}  {cpu_name()}  torch {torch.__version__}  threads {torch.get_num_threads()}  "
          f"{args.model} --quantization {args.quantization}, {args.tokens} tokens per request, greedy, "
          f"--speculative-num-draft-tokens {args.draft_tokens}")
    for workload, texts in WORKLOADS.items():
        for streams in (int(s) for s in args.streams.split(",")):
            prompts = [tokenizer.apply_chat_template([{"role": "user", "content": texts[i % len(texts)]}],
                                                     add_generation_prompt=True, tokenize=True, return_dict=False)
                       for i in range(streams)]
            rates: dict[str, list[float]] = {name: [] for name in engines}
            for attempt in range(3):
                for name, engine in engines.items():
                    rates[name].append(run_once(engine, prompts, args.tokens, f"{workload}-{streams}-{attempt}"))
            off, on = statistics.median(rates["none"]), statistics.median(rates["ngram"])
            stats = engines["ngram"].stats()  # type: ignore[attr-defined]
            print(f"{workload:5} {streams:2} stream(s): off {off:6.1f} tok/s, ngram {on:6.1f} tok/s: {on / off:.2f}x"
                  f"  (since start: {stats.spec_accepted_tokens}/{stats.spec_drafted_tokens} drafts accepted, "
                  f"{stats.spec_emitted_tokens / max(1, stats.spec_verify_rows):.2f} tokens per verify row)")


if __name__ == "__main__":
    main()
