"""ringserve's engine in-process (no bus, no HTTP): what the ring costs on top of the engine's own steps.

Level 1 runs the level's requests one at a time; the max level adds all of its requests at once and steps until
idle. Reported: output tok/s and the decode step time (steps after every request has its first token).
Everything that touches the engine's API is in `_engine_run`, so an API change is a one-place fix.
"""

from __future__ import annotations

import argparse
import os
import shlex
import time
from typing import Any

import torch

from bench.metrics import percentile


def _engine_run(model_spec: str, server_args: str, prompt_sets: list[list[list[int]]],
                max_tokens: int) -> list[tuple[float, int, list[float]]]:
    """Build one engine (engine flags parsed from `server_args`), run each prompt set to completion.

    Per set: (wall seconds, output tokens, durations of the decode-only steps).
    """
    from ringserve.actors.common.model_source import resolve_model
    from ringserve.actors.engine.config import EngineConfig
    from ringserve.actors.engine.scheduling.engine_core import EngineCore
    from ringserve.bus.messages import TokenizedRequest, SamplingParams

    parser = argparse.ArgumentParser(add_help=False)
    EngineConfig.add_arguments(parser)
    config = EngineConfig.from_args(parser.parse_known_args(shlex.split(server_args))[0])
    engine = EngineCore.from_source(resolve_model(model_spec), config)
    params = SamplingParams(max_new_tokens=max_tokens, temperature=0.0)  # no stop ids: like ignore_eos
    engine.add_request(TokenizedRequest("warmup", prompt_sets[0][0], SamplingParams(max_new_tokens=4)))
    while engine.has_work():
        engine.step()
    runs = []
    for n, prompts in enumerate(prompt_sets):
        for i, ids in enumerate(prompts):
            rejection = engine.add_request(TokenizedRequest(f"r{n}-{i}", ids, params))
            if rejection is not None:
                raise RuntimeError(f"the engine refused a benchmark request: {rejection.message}")
        started: set[str] = set()
        decode_steps: list[float] = []
        tokens, start = 0, time.perf_counter()
        while engine.has_work():
            t0 = time.perf_counter()
            rows = engine.step()
            dt = time.perf_counter() - t0
            if len(started) == len(prompts):
                decode_steps.append(dt)
            started.update(row.rid for row in rows)
            tokens += sum(len(row.token_ids) for row in rows)
        runs.append((time.perf_counter() - start, tokens, decode_steps))
        engine.flush_cache()
    return runs


def run_engine_baseline(model_spec: str, server_args: str, level_prompts: dict[int, list[list[int]]],
                        max_tokens: int, threads: int = 0) -> dict[int, dict[str, float]]:
    """Level 1 one request at a time, other levels all at once; tok/s and decode step ms per level.

    `threads` is torch's thread count (0 = one per core, as the scheduler's default).
    """
    torch.set_num_threads(threads or os.cpu_count() or 1)
    sets: list[list[list[int]]] = []
    order: list[tuple[int, int]] = []  # (level, number of sets)
    for level, prompts in level_prompts.items():
        batches = [[p] for p in prompts] if level == 1 else [prompts[i:i + level]
                                                              for i in range(0, len(prompts), level)]
        order.append((level, len(batches)))
        sets += batches
    runs = _engine_run(model_spec, server_args, sets, max_tokens)
    results: dict[int, dict[str, float]] = {}
    k = 0
    for level, count in order:
        chunk = runs[k:k + count]
        k += count
        wall, tokens = sum(r[0] for r in chunk), sum(r[1] for r in chunk)
        steps = [s * 1e3 for r in chunk for s in r[2]]
        results[level] = {"output_tok_s": tokens / wall, "seconds": wall, "tokens": tokens,
                          "decode_step_ms_p50": percentile(steps, 50),
                          "decode_step_ms_mean": sum(steps) / len(steps) if steps else float("nan")}
        print(f"  engine batch {level:>3}: {tokens / wall:7.1f} tok/s, decode step p50 "
              f"{results[level]['decode_step_ms_p50']:.1f} ms", flush=True)
    return results


def engine_prompts(model_spec: str, conversations: dict[int, list[list[dict[str, str]]]]) -> dict[int, Any]:
    """The levels' conversations as token ids, with the served model's tokenizer and chat template."""
    from ringserve.actors.common.model_source import load_tokenizer, resolve_model
    from bench.hf_baseline import encode_conversations

    tokenizer = load_tokenizer(resolve_model(model_spec))
    return {level: encode_conversations(tokenizer, convs) for level, convs in conversations.items()}
