"""Offline batch benchmark: `ringserve.Engine.generate` over N prompts against transformers' static batches and
against the same prompts through the ring's HTTP `/generate`, in one run.

    .venv/bin/python bench/offline_bench.py --num-prompts 256 --max-new-tokens 64 --output-json /tmp/offline.json

Every run decodes the same token ids (the benchmark's chat prompts through the chat template, as
bench/hf_baseline.py encodes them), greedily, exactly `--max-new-tokens` each (`ignore_eos`; transformers:
`min_new_tokens`). In order, so nothing competes for the cores: transformers in this process, static batches
of `--hf-batch` (torch on every core); then one Engine with its HTTP entry on (`http=True`): the whole list in
one `Engine.generate` call, and the same prompts as concurrent `/generate` requests (one per prompt, all at
once), the prefix cache flushed before each. Prints output tok/s of each and the ratios, with the date and CPU;
`--server-args` go to the Engine as `ringserve serve` flags.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: make `bench.` importable
os.environ.setdefault("TQDM_DISABLE", "1")  # no weight-loading progress bars in the report

from bench.bench_serving import machine_info, warn_if_busy  # noqa: E402
from bench.hf_baseline import encode_conversations, run_hf_baseline  # noqa: E402
from bench.workload import level_conversations  # noqa: E402

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--hf-batch", type=int, default=32, help="transformers static batch size")
    parser.add_argument("--skip-hf", action="store_true", help="leave out the transformers baseline")
    parser.add_argument("--server-args", default="", help='ringserve serve flags for the Engine, e.g. '
                                                          '"--max-running-requests 128"')
    parser.add_argument("--output-json", default=None)
    return parser.parse_args(argv)


def engine_flags(server_args: str) -> dict[str, Any]:
    """`--flag value` / `--switch` pairs as Engine keyword arguments."""
    flags: dict[str, Any] = {}
    tokens = shlex.split(server_args)
    i = 0
    while i < len(tokens):
        name = tokens[i].removeprefix("--").replace("-", "_")
        if i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            flags[name], i = tokens[i + 1], i + 2
        else:
            flags[name], i = True, i + 1
    return flags


async def http_generate_all(base_url: str, prompts: list[list[int]], sampling: dict[str, Any]) -> int:
    """Every prompt as its own concurrent `/generate` request; the output tokens made."""
    import httpx

    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    async with httpx.AsyncClient(base_url=base_url, timeout=3600, limits=limits) as client:
        async def one(ids: list[int]) -> int:
            reply = await client.post("/generate", json={"input_ids": ids, "sampling_params": sampling})
            reply.raise_for_status()
            return reply.json()["meta_info"]["completion_tokens"]

        return sum(await asyncio.gather(*(one(ids) for ids in prompts)))


def timed(label: str, run: Any) -> dict[str, float]:
    start = time.perf_counter()
    tokens = run()
    seconds = time.perf_counter() - start
    print(f"  {label:<28} {tokens / seconds:8.1f} tok/s ({tokens} tokens, {seconds:.1f} s)", flush=True)
    return {"output_tok_s": tokens / seconds, "seconds": seconds, "tokens": tokens}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from ringserve.actors.common.model_source import load_tokenizer, resolve_model

    conversations = level_conversations(args.num_prompts)
    prompts = encode_conversations(load_tokenizer(resolve_model(args.model)), conversations)
    sampling = {"max_new_tokens": args.max_new_tokens, "temperature": 0, "ignore_eos": True}
    load = warn_if_busy("before the run")
    print(f"{args.num_prompts} prompts x {args.max_new_tokens} new tokens, model {args.model}", flush=True)
    results: dict[str, Any] = {}
    if not args.skip_hf:
        hf = run_hf_baseline(args.model, {args.hf_batch: conversations}, args.max_new_tokens)[args.hf_batch]
        results["transformers"] = {k: hf[k] for k in ("output_tok_s", "seconds", "tokens")}

    import ringserve

    with ringserve.Engine(model=args.model, http=True, **engine_flags(args.server_args)) as engine:
        engine.generate(input_ids=prompts[:4], sampling_params={**sampling, "max_new_tokens": 4})  # warm up
        engine.flush_cache()
        results["engine"] = timed("Engine.generate (one call)", lambda: sum(
            r.meta_info["completion_tokens"] for r in engine.generate(input_ids=prompts, sampling_params=sampling,
                                                                      progress=False)))
        engine.flush_cache()
        assert engine.http_url is not None
        results["http"] = timed(f"HTTP /generate x {len(prompts)}",
                                lambda: asyncio.run(http_generate_all(engine.http_url, prompts, sampling)))

    engine_tps = results["engine"]["output_tok_s"]
    ratios = {"engine_vs_http": engine_tps / results["http"]["output_tok_s"]}
    if "transformers" in results:
        ratios["engine_vs_transformers"] = engine_tps / results["transformers"]["output_tok_s"]
    machine = machine_info()
    print(f"\n{datetime.date.today().isoformat()}, {machine['cpu']} ({machine['cores']} cores)")
    print("| run | output tok/s | seconds |\n|---|---|---|")
    names = {"engine": "Engine.generate", "http": "HTTP /generate", "transformers": f"transformers, batch {args.hf_batch}"}
    for key, row in results.items():
        print(f"| {names[key]} | {row['output_tok_s']:.1f} | {row['seconds']:.1f} |")
    print("  ".join(f"{name}: {value:.2f}x" for name, value in ratios.items()))
    if args.output_json:
        report = {"date": datetime.date.today().isoformat(), "machine": {**machine, "load_avg_1m_before": load},
                  "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens, "hf_batch": args.hf_batch,
                  "model": args.model, "server_args": args.server_args, "results": results, "ratios": ratios}
        Path(args.output_json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
