"""Host cost per generated token from the first to the 8k-th: the scheduler's and the detokenizer's own work.

    .venv/bin/python bench/per_token_cost.py --tokens 8192

The model's forward gets dearer as the context grows (attention reads all of it); the work around it must
not. One request generates `--tokens` tokens (sampled, with stop strings set so the stop check runs every
step) on a tiny random-weight Llama that uses the real model's tokenizer, so the forward is small and the
host work shows. Timed per step: the engine's `schedule` and `finish` (admission, slot allocation, stop
checks, caching) and the scheduler actor's conversion of a row to its wire message and its msgpack encoding;
then the same ids through the detokenizer's `IncrementalDecoder`, one token per feed, with the same stops.
Prints the median per token in each 1k-token window and the last window against the second (the first holds
the warm-up); flat means a ratio near 1.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

STOPS = ["<never-generated-stop>", "\n\nUser:"]


def engine_costs(tokenizer: object, tokens: int, seed: int) -> tuple[list[float], list[float], list[int]]:
    """Per step: engine host seconds (schedule + finish + encoding the rows), forward seconds; the ids."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ringserve.actors.engine.config import EngineConfig
    from ringserve.actors.engine.scheduling.engine_core import EngineCore
    from ringserve.actors.engine.models.weights import model_from_hf
    from ringserve.bus.codec import encode
    from ringserve.bus.messages import BatchTokenOutput, SamplingParams, TokenizedRequest

    torch.manual_seed(seed)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,  # type: ignore[arg-type]
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=tokens + 64, tie_word_embeddings=False)).eval()
    model = model_from_hf(hf.config, hf.state_dict(), "cpu")
    engine = EngineCore(model, EngineConfig(device="cpu", max_total_tokens=tokens + 256), tokenizer)
    prompt = tokenizer.encode("Write a very long story about the sea.")  # type: ignore[attr-defined]
    params = SamplingParams(max_new_tokens=tokens, temperature=1.0, seed=seed, stop=list(STOPS))
    assert engine.add_request(TokenizedRequest("long", prompt, params)) is None
    host: list[float] = []
    forward: list[float] = []
    ids: list[int] = []
    while engine.has_work():
        t0 = time.perf_counter()
        batch = engine.schedule()
        t1 = time.perf_counter()
        assert batch is not None
        out = engine.launch(batch)
        out.wait()
        t2 = time.perf_counter()
        rows = engine.finish(batch, out)
        encode(BatchTokenOutput(step=len(host), rows=rows))
        t3 = time.perf_counter()
        host.append((t1 - t0) + (t3 - t2))
        forward.append(t2 - t1)
        for row in rows:
            ids += row.token_ids
            if row.finish is not None and row.finish.type != "length":
                raise RuntimeError(f"the request ended early: {row.finish}")
    return host, forward, ids


def detokenizer_costs(tokenizer: object, ids: list[int]) -> list[float]:
    """Seconds of each one-token feed of `ids` through the detokenizer's IncrementalDecoder."""
    from ringserve.actors.detokenizer.incremental import IncrementalDecoder
    from ringserve.bus.messages import DecodeParams, FinishReason

    decoder = IncrementalDecoder(tokenizer, DecodeParams(stop=list(STOPS)))
    costs = []
    for i, token in enumerate(ids):
        finish = FinishReason("length") if i == len(ids) - 1 else None
        t0 = time.perf_counter()
        decoder.feed([token], finish)
        costs.append(time.perf_counter() - t0)
    return costs


def windows(values: list[float], size: int = 1024) -> list[float]:
    """Median of each consecutive `size`-long window (the last partial one dropped if under half full)."""
    out = []
    for start in range(0, len(values), size):
        chunk = values[start:start + size]
        if len(chunk) >= size // 2:
            out.append(statistics.median(chunk))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="whose tokenizer to use")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens to generate (default: 8192)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from ringserve.actors.common.model_source import load_tokenizer, resolve_model

    torch.set_num_threads(1)
    tokenizer = load_tokenizer(resolve_model(args.model))
    host, forward, ids = engine_costs(tokenizer, args.tokens, args.seed)
    detok = detokenizer_costs(tokenizer, ids)
    print(f"{len(ids)} tokens generated; median per token in each 1k window:")
    print(f"{'window':>10} {'scheduler host us':>18} {'detokenizer us':>15} {'forward us':>11}")
    rows = list(zip(windows(host), windows(detok), windows(forward)))
    for k, (h, d, f) in enumerate(rows):
        print(f"{k * 1024:>5}-{(k + 1) * 1024:<5}{h * 1e6:>18.0f}{d * 1e6:>15.0f}{f * 1e6:>11.0f}")
    if len(rows) >= 3:
        (h1, d1, f1), (hn, dn, fn) = rows[1], rows[-1]
        print(f"last window / second window: scheduler host {hn / h1:.2f}x, detokenizer {dn / d1:.2f}x "
              f"(forward, which reads the whole context: {fn / f1:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
