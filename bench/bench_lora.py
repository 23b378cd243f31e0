"""Multi-LoRA throughput: 32 greedy streams of SmolLM2-135M over 0 (the base), 1, 4 and 8 adapters, and the
time to load an adapter.

    .venv/bin/python bench/bench_lora.py [--streams 32] [--tokens 32] [--rank 16] [--max-lora-rank 16]

Two engines in one process: one without LoRA (the base's figure) and one with 8 PEFT adapters of `--rank` on
every projection registered (`--max-loras-per-batch 8`, slots of `--max-lora-rank`); the rounds alternate the
base and the adapter mixes. Each wrapped projection runs the segmented op (kernels/lora.py): a token computes
only its own adapter's slot, so 1, 4 and 8 adapters should cost about the same. Every measurement prefills its
own fresh prompts (none cached by an earlier one) and then decodes. Steps run eagerly (no compiled graphs).
Prints tokens per second per mix: the best round (on a shared host, the one other work disturbed least) with
its ratio to the base's best, and the median; then the median load time.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_moe import cpu_name  # noqa: E402


def make_adapters(source: Any, root: Path, count: int, rank: int) -> list[Path]:
    """`count` random PEFT adapters of `rank` on every projection of the model at `source` (a ModelSource)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(source.directory, dtype=torch.float32, **source.hf_kwargs())
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(hf, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))
    paths = []
    for i in range(count):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    torch.nn.init.normal_(p, std=0.02)
        model.save_pretrained(str(root / f"a{i}"))
        paths.append(root / f"a{i}")
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=40)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-lora-rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    from ringserve.actors.common.model_source import resolve_model
    from ringserve.actors.engine.config import EngineConfig
    from ringserve.actors.engine.scheduling.engine_core import EngineCore
    from ringserve.bus.messages import SamplingParams, TokenizedRequest

    torch.set_num_threads(args.threads)
    source = resolve_model("SmolLM2-135M-Instruct")
    root = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    paths = make_adapters(source, root, 8, args.rank)
    common = dict(device="cpu", max_total_tokens=16384, torch_threads=args.threads, disable_cuda_graph=True)
    base = EngineCore.from_source(source, EngineConfig(**common))
    lora = EngineCore.from_source(source, EngineConfig(**common, max_lora_rank=args.max_lora_rank,
                                                   lora_modules=",".join(f"a{i}={p}" for i, p in enumerate(paths))))
    loads = []
    for i, p in enumerate(paths):
        started = time.perf_counter()
        assert lora.load_lora(f"again{i}", str(p)) is None
        loads.append(time.perf_counter() - started)
    rng = random.Random(0)

    def rate(engine: EngineCore, adapters: int, tag: str) -> float:
        prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_tokens)] for _ in range(args.streams)]
        for i, prompt in enumerate(prompts):
            name = f"a{i % adapters}" if adapters else None
            engine.add_request(TokenizedRequest(f"{tag}-{i}", prompt, SamplingParams(
                max_new_tokens=args.tokens, temperature=0.0, ignore_eos=True, lora_name=name)))
        started = time.perf_counter()
        while engine.has_work():
            engine.step()
        return args.streams * args.tokens / (time.perf_counter() - started)

    rate(base, 0, "warm-base"), rate(lora, 8, "warm-lora")
    mixes = {"base": (base, 0), "1 adapter": (lora, 1), "4 adapters": (lora, 4), "8 adapters": (lora, 8)}
    rates: dict[str, list[float]] = {m: [] for m in mixes}
    for r in range(args.rounds):
        for mix, (engine, adapters) in (mixes.items() if r % 2 == 0 else reversed(mixes.items())):
            rates[mix].append(rate(engine, adapters, f"{mix}-{r}"))
    best = {m: max(v) for m, v in rates.items()}
    print(f"{date.today()}  {cpu_name()}  torch {torch.__version__}  threads {args.threads}  {args.streams} streams x "
          f"{args.tokens} tokens, rank {args.rank} on every projection, --max-lora-rank {args.max_lora_rank}, "
          f"--max-loras-per-batch 8")
    for mix, value in best.items():
        print(f"  {mix}: best {value:.0f} tok/s ({value / best['base']:.2f}x the base's best), median "
              f"{statistics.median(rates[mix]):.0f} of {args.rounds} rounds")
    print(f"  adapter load (read, check, host copy): median {statistics.median(loads) * 1000:.0f} ms")


if __name__ == "__main__":
    main()
