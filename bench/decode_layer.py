"""Does running each decoder layer of a decode step as one C++ op pay? Two engines in one process, compared.

    .venv/bin/python bench/decode_layer.py --quantization gguf --batches 1,8,32 --context 128,1024

Both engines are built as the server builds them (compiled decode graphs, compile_check.py's settings); in the
second every layer's `fused_decode` is switched off before its graphs compile, so it runs the layers' own
modules (four linears, the fused element-wise kernels Inductor makes, the KV write and attention: ten ops a
layer). Their graphs are stored apart (the flag is part of a graph's name), so a second run loads both. For
each batch size and context, both engines prefill the same prompts, then their decode steps alternate (the
same load on the machine for both); prints the median step of each and the ratio, with the date and CPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.compile_check import build_engine, prompt_ids  # noqa: E402


def ready_engine(quantization: str, max_bs: int, batches: list[int], fused: bool) -> object:
    """An engine whose compiled graphs for `batches` are ready; its layers fused or not."""
    engine = build_engine("SmolLM2-135M-Instruct", quantization, max_bs)
    for layer in engine.runner.model.model.layers:  # type: ignore[attr-defined]
        layer.fused_decode = layer.fused_decode and fused
    graphs = engine.runner.graphs  # type: ignore[attr-defined]
    if graphs is None or graphs.compiler is None:
        raise SystemExit("no compiled decode graphs here (CPU kernels not built?)")
    graphs.compiler.choose = False
    # sizes asked for directly, not through start_decode_graphs: the steps timed then queue no other size's
    # compile, which would run beside them
    threads = torch.get_num_threads()
    for size in sorted({graphs.padded_size(b) for b in batches}):
        graphs.compiler.request((size, threads))
        graphs.compiler.wait((size, threads), 1800)
    return engine


def alternating_steps(engines: list[object], batch: int, context: int, steps: int) -> list[float]:
    """Median decode step (ms) of each engine, `batch` requests of `context` tokens, steps alternated."""
    from ringserve.bus.messages import SamplingParams, TokenizedRequest

    # enough tokens that no request ends before the last is admitted (the first decode while the rest prefill)
    params = SamplingParams(max_new_tokens=steps + 8 + batch * context // 256, temperature=0.0, ignore_eos=True)
    for engine in engines:
        for i in range(batch):
            engine.add_request(TokenizedRequest(f"b{batch}-{context}-{i}", prompt_ids(engine, i, context), params))  # type: ignore[attr-defined]
        while engine.stats().num_waiting_reqs or engine.stats().num_running_reqs < batch:  # type: ignore[attr-defined]
            engine.step()  # type: ignore[attr-defined]
    times: list[list[float]] = [[] for _ in engines]
    for _ in range(steps):
        for k, engine in enumerate(engines):
            start = time.perf_counter()
            engine.step()  # type: ignore[attr-defined]
            times[k].append(time.perf_counter() - start)
    for engine in engines:
        while engine.has_work():  # type: ignore[attr-defined]
            engine.step()  # type: ignore[attr-defined]
    return [statistics.median(t) * 1e3 for t in times]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quantization", default="gguf", help="a --quantization method with group kernels")
    parser.add_argument("--batches", default="1,8,32", help="comma-separated decode batch sizes")
    parser.add_argument("--context", default="128,1024", help="comma-separated prompt lengths")
    parser.add_argument("--steps", type=int, default=24, help="decode steps timed per engine and case")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    from ringserve.kernels.cpu.host import cpu_info

    print(f"host: {cpu_info()['model']}, {torch.get_num_threads()} torch threads, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    engines = [ready_engine(args.quantization, max(batches), batches, fused) for fused in (True, False)]
    for context in (int(c) for c in args.context.split(",")):
        for batch in batches:
            fused, modules = alternating_steps(engines, batch, context, args.steps)
            print(f"{args.quantization} batch {batch:3d} context {context:5d}: one op per layer {fused:7.2f} ms/step, "
                  f"layer modules {modules:7.2f} ms/step, {modules / fused:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
