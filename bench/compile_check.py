"""Does `torch.compile` make the CPU engine faster here? Decode steps timed eager and compiled, side by side.

    .venv/bin/python bench/compile_check.py --batches 1,32

Builds the engine on the default model twice in one process: as the server runs it (eager), and with
`torch.compile(dynamic=True)` applied to each decoder layer's MLP and norms, to the final norm and to the LM
head (the parts whose small element-wise ops Inductor can fuse; attention goes through the paged backend,
which stays eager). For each batch size it prefills that many prompts, then times `--steps` decode steps.
Prints the compiled/eager step time per batch size and the compile time, so the choice to stay eager can be
re-checked on any machine.
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


def build_engine(model: str, compiled: bool) -> object:
    from actors.common.model_source import resolve_model
    from actors.engine.config import EngineConfig
    from actors.engine.engine import Engine

    engine = Engine.from_source(resolve_model(model), EngineConfig(device="cpu", dtype="float32",
                                                                    max_total_tokens=32768))
    if compiled:
        net = engine.runner.model
        for layer in net.model.layers:
            layer.mlp = torch.compile(layer.mlp, dynamic=True)
            layer.input_layernorm = torch.compile(layer.input_layernorm, dynamic=True)
            layer.post_attention_layernorm = torch.compile(layer.post_attention_layernorm, dynamic=True)
        net.model.norm = torch.compile(net.model.norm, dynamic=True)
        net.lm_head = torch.compile(net.lm_head, dynamic=True)
    return engine


def decode_step_ms(engine: object, batch: int, steps: int) -> float:
    """Median decode step time with `batch` requests running (after their prefill)."""
    from bus.messages import TokenizedRequest, SamplingParams

    tokenizer = engine.tokenizer  # type: ignore[attr-defined]
    params = SamplingParams(max_new_tokens=steps + 4, temperature=0.0)
    for i in range(batch):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": user_prompt(i)}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        engine.add_request(TokenizedRequest(f"b{batch}-{i}", ids, params))  # type: ignore[attr-defined]
    times = []
    with torch.no_grad():
        engine.step()  # type: ignore[attr-defined]  # the prefill
        while engine.has_work():  # type: ignore[attr-defined]
            t0 = time.perf_counter()
            engine.step()  # type: ignore[attr-defined]
            times.append(time.perf_counter() - t0)
    return statistics.median(times[2:]) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--batches", default="1,32", help="comma-separated decode batch sizes")
    parser.add_argument("--steps", type=int, default=24, help="decode steps timed per batch size")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    torch.set_num_threads(torch.get_num_threads())
    results: dict[str, dict[int, float]] = {}
    for compiled in (False, True):
        engine = build_engine(args.model, compiled)
        t0 = time.perf_counter()
        for b in batches:  # warm-up (and, compiled, compile every shape class) before timing
            decode_step_ms(engine, b, 4)
        warm = time.perf_counter() - t0
        name = "compiled" if compiled else "eager"
        results[name] = {b: decode_step_ms(engine, b, args.steps) for b in batches}
        print(f"{name:9s} warm-up {warm:6.1f} s; decode step ms: "
              + ", ".join(f"batch {b}: {ms:.1f}" for b, ms in results[name].items()), flush=True)
    for b in batches:
        print(f"batch {b}: compiled / eager step time {results['compiled'][b] / results['eager'][b]:.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
