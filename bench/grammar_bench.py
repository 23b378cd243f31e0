"""Output constraints on the engine in-process (no bus, no HTTP), SmolLM2-135M, ratios from one run.

1. Mask cost: `--streams` requests at once, `--max-tokens` tokens each, all unconstrained against half of
   them constrained by a JSON schema (a long free string field, so every request runs the full length). The
   ratio is output tok/s of the mix over the unconstrained run (issue target: >= 0.9).
2. Jump-forward: one stream of schema-constrained JSON with several fixed keys, output tok/s with
   jump-forward on over off (target: >= 1.3).
3. Compile time of the schemas, first and cached.

Run with nothing else on the machine: `python -m bench.grammar_bench` (prints the table; `--json` writes it).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from typing import Any


LONG_STRING = {"type": "object", "properties": {"answer": {"type": "string", "minLength": 400}},
               "required": ["answer"]}
FIXED_KEYS = {"type": "object", "additionalProperties": False,
              "required": ["name", "age", "city", "member", "tier", "score"],
              "properties": {"name": {"enum": ["Ann", "Bob", "Cy"]}, "age": {"type": "integer", "minimum": 0,
                                                                               "maximum": 99},
                             "city": {"enum": ["Paris", "Rome"]}, "member": {"type": "boolean"},
                             "tier": {"enum": ["gold", "silver"]}, "score": {"type": "integer", "minimum": 0,
                                                                             "maximum": 9}}}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _engine(**flags: Any) -> Any:
    from ringserve.actors.common.model_source import DEFAULT_MODEL, resolve_model
    from ringserve.actors.engine.config import EngineConfig
    from ringserve.actors.engine.scheduling.engine_core import EngineCore

    return EngineCore.from_source(resolve_model(DEFAULT_MODEL), EngineConfig(device="cpu", **flags))


def _run(engine: Any, requests: list[Any]) -> tuple[float, int, int]:
    """Seconds, output tokens and steps to run `requests` to completion."""
    for req in requests:
        error = engine.add_request(req)
        if error is not None:
            raise RuntimeError(error.message)
    steps0, tokens, start = engine.counters.steps, 0, time.perf_counter()
    while engine.has_work():
        tokens += sum(len(row.token_ids) for row in engine.step())
    seconds = time.perf_counter() - start
    engine.flush_cache()
    return seconds, tokens, engine.counters.steps - steps0


def _requests(tag: str, prompts: list[list[int]], max_tokens: int, schema: dict | None, every: int = 1) -> list[Any]:
    from ringserve.bus.messages import TokenizedRequest
    from ringserve.bus.params import SamplingParams

    out = []
    for i, ids in enumerate(prompts):
        grammar = json.dumps(schema) if schema is not None and i % every == 0 else None
        params = SamplingParams(max_new_tokens=max_tokens, temperature=0.0, json_schema=grammar)
        out.append(TokenizedRequest(f"{tag}-{i}", ids, params))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--jf-runs", type=int, default=4, help="single-stream JSON requests per jump-forward setting")
    p.add_argument("--json", default="", help="write the results here")
    args = p.parse_args(argv)
    engine = _engine()
    tok = engine.tokenizer
    prompts = [tok.encode(f"Describe item {i} of the catalogue in one paragraph.") for i in range(args.streams)]
    _run(engine, _requests("warm", prompts[:2], 4, LONG_STRING))  # loads xgrammar, compiles, warms the kernels
    results: dict[str, Any] = {"cpu": _cpu_model(), "date": time.strftime("%Y-%m-%d")}

    free = _run(engine, _requests("free", prompts, args.max_tokens, None))
    mixed = _run(engine, _requests("mix", prompts, args.max_tokens, LONG_STRING, every=2))
    results["mask"] = {"unconstrained_tok_s": free[1] / free[0], "half_constrained_tok_s": mixed[1] / mixed[0],
                       "ratio": (mixed[1] / mixed[0]) / (free[1] / free[0]), "tokens": [free[1], mixed[1]]}

    jf = {}
    for label, flags in (("off", {"disable_jump_forward": True}), ("on", {})):
        eng = engine if label == "on" else _engine(**flags)
        _run(eng, _requests(f"jfwarm{label}", [prompts[-1]], 8, FIXED_KEYS))
        seconds = tokens = steps = 0
        for i in range(args.jf_runs):
            s, t, n = _run(eng, _requests(f"jf{label}{i}", [prompts[i]], 64, FIXED_KEYS))
            seconds, tokens, steps = seconds + s, tokens + t, steps + n
        jf[label] = {"tok_s": tokens / seconds, "tokens": tokens, "steps": steps}
    jf["ratio"] = jf["on"]["tok_s"] / jf["off"]["tok_s"]
    results["jump_forward"] = jf

    from ringserve.kernels.grammar import GrammarSpec, make_compiler

    compiler = make_compiler(tok, engine.vocab_size)
    compile_times = {}
    for name, schema in (("long_string", LONG_STRING), ("fixed_keys", FIXED_KEYS)):
        spec = GrammarSpec("json_schema", json.dumps(schema))
        t0 = time.perf_counter()
        compiler.compile(spec)
        t1 = time.perf_counter()
        compiler.compile(spec)
        compile_times[name] = {"first_ms": (t1 - t0) * 1e3, "cached_us": (time.perf_counter() - t1) * 1e6}
    results["compile"] = compile_times

    m = results["mask"]
    engine.on_idle()  # takes the thread counts the tuner settled on
    results["torch_threads"] = engine.stats().torch_threads
    print(f"host: {results['cpu']}, torch threads per step size {results['torch_threads']}, {results['date']}")
    print(f"mask cost, {args.streams} streams x {args.max_tokens} tokens: unconstrained {m['unconstrained_tok_s']:.1f} "
          f"tok/s, half constrained {m['half_constrained_tok_s']:.1f} tok/s, ratio {m['ratio']:.3f}")
    print(f"jump-forward, 1 stream JSON with 6 fixed keys: off {jf['off']['tok_s']:.1f} tok/s ({jf['off']['steps']} "
          f"steps), on {jf['on']['tok_s']:.1f} tok/s ({jf['on']['steps']} steps), ratio {jf['ratio']:.2f}")
    for name, c in compile_times.items():
        print(f"compile {name}: first {c['first_ms']:.2f} ms, cached {c['cached_us']:.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
