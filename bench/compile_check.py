"""Do compiled CPU decode graphs pay here? Decode steps timed eager and compiled, interleaved, in one engine.

    .venv/bin/python bench/compile_check.py --quantization none,gguf --batches 1,8,32 --context 512

For each quantization, builds the engine as the server does (decode graphs in compile mode, actors/engine/
decode_graph.py), compiles the graph of every batch size asked for (kept even where it measures slower, so both
can be timed), and reports how long the first size took to be ready from the engine's construction: on a second
run, which loads the graphs the first stored (actors/engine/runner/graphs/graph_store.py), that is the warm start
(`RINGSERVE_GRAPH_STORE=0` traces every graph again). Then for each batch size it prefills that many
prompts of `--context` tokens and times decode steps, alternating eager and compiled steps of the same engine
(the same requests, the same load on the machine), and prints the median of each and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.workload import user_prompt  # noqa: E402


def build_engine(model: str, quantization: str, max_bs: int) -> object:
    from ringserve.actors.common.model_source import resolve_model
    from ringserve.actors.engine.config import EngineConfig
    from ringserve.actors.engine.scheduling.engine_core import EngineCore

    config = EngineConfig(device="cpu", quantization=quantization, cuda_graph_max_bs=max_bs,
                          max_running_requests=max_bs, max_total_tokens=65536, disable_radix_cache=True,
                          torch_threads=torch.get_num_threads())  # fixed: each graph is compiled for one count
    return EngineCore.from_source(resolve_model(model), config)


def prompt_ids(engine: object, i: int, context: int) -> list[int]:
    """A chat prompt of about `context` tokens (the workload's user prompts, repeated)."""
    tokenizer = engine.tokenizer  # type: ignore[attr-defined]
    text = user_prompt(i)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    while len(ids) < context:
        text += " " + user_prompt(i + len(ids))
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
    return ids[-context:]


def interleaved_steps(engine: object, batch: int, context: int, steps: int) -> tuple[float, float]:
    """Median eager and compiled decode step times (ms) with `batch` requests of `context` tokens."""
    from ringserve.bus.messages import SamplingParams, TokenizedRequest

    runner = engine.runner  # type: ignore[attr-defined]
    graphs = runner.graphs
    params = SamplingParams(max_new_tokens=2 * steps + 4, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(TokenizedRequest(f"b{batch}-{i}", prompt_ids(engine, i, context), params))  # type: ignore[attr-defined]
    while engine.stats().num_waiting_reqs or engine.stats().num_running_reqs < batch:  # type: ignore[attr-defined]
        engine.step()  # type: ignore[attr-defined]  # the prefills
    times: dict[bool, list[float]] = {False: [], True: []}
    for k in range(2 * steps):
        compiled = k % 2 == 1
        runner.graphs = graphs if compiled else None
        start = time.perf_counter()
        engine.step()  # type: ignore[attr-defined]
        times[compiled].append(time.perf_counter() - start)
    runner.graphs = graphs
    while engine.has_work():  # type: ignore[attr-defined]
        engine.step()  # type: ignore[attr-defined]
    return statistics.median(times[False]) * 1e3, statistics.median(times[True]) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--quantization", default="none,gguf", help="comma-separated --quantization methods")
    parser.add_argument("--batches", default="1,8,32", help="comma-separated decode batch sizes")
    parser.add_argument("--context", type=int, default=512, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed per batch size and mode")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    from ringserve.kernels.cpu.host import cpu_info

    print(f"host: {cpu_info()['model']}, {torch.get_num_threads()} torch threads, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}", flush=True)
    for quantization in args.quantization.split(","):
        started = time.perf_counter()
        engine = build_engine(args.model, quantization, max(batches))
        graphs = engine.runner.graphs  # type: ignore[attr-defined]
        if graphs is None or graphs.compiler is None:
            print(f"{quantization}: no compiled decode graphs here (CPU kernels not built?)")
            continue
        graphs.compiler.choose = False
        engine.start_decode_graphs()  # type: ignore[attr-defined]
        sizes = sorted({graphs.padded_size(b) for b in batches})
        threads = torch.get_num_threads()
        graphs.compiler.wait((sizes[0], threads), 1800)
        first = time.perf_counter() - started
        for size in sizes:
            graphs.compiler.request((size, threads))
        for size in sizes:
            graphs.compiler.wait((size, threads), 1800)
        print(f"{quantization}: engine built and size {sizes[0]} compiled {first:.1f} s after start; "
              f"all sizes {time.perf_counter() - started:.1f} s; {graphs.report()}", flush=True)
        for batch in batches:
            eager, compiled = interleaved_steps(engine, batch, args.context, args.steps)
            print(f"{quantization:5s} batch {batch:3d} context {args.context}: eager {eager:7.2f} ms/step, "
                  f"compiled {compiled:7.2f} ms/step, speedup {eager / compiled:.2f}x", flush=True)
        graphs.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
