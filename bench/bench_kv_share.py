"""KV beyond one replica: the first token of a request for a long shared document on the replica that does not hold
it, with the blocks fetched from the replica that does (`--kv-share`) against computed; a prefix evicted to the KV
tier, loaded against computed; and a prefill/decode split (`--replica-role prefill,decode`) against one replica doing
both, at 8 streams.

    .venv/bin/python bench/bench_kv_share.py [--doc-tokens 2048] [--trials 4] [--split-prompt 512]

One ring of SmolLM2-135M (`--dp 2 --kv-tier-bytes 2 GiB --kv-share`) on a NATS server the benchmark starts, so it
can hand requests straight to a replica as round-robin routing would. Each trial takes a new document: replica 0
answers a question on it (computing it), then replica 1 answers another question on it, once told that replica 0
holds it (a fetch) and once not (it computes); the two orders alternate between trials. Then, on replica 0, a
document pushed out of the pool into the tier by other documents is asked again (a tier load) against a new
document of the same length (computed); the tier's loaded-block counter must rise, or the figure is refused.
Last, two rings in turn serve the same 8 concurrent streams of distinct prompts over HTTP: `--dp 2 --replica-role
prefill,decode` and `--dp 1`. Prints each time to first token, the medians and their ratios, and the split's
throughput and first-token time against one replica's.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import random
import statistics
import sys
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_moe import cpu_name  # noqa: E402
from bench.server import launch  # noqa: E402
import httpx  # noqa: E402
from ringserve.bus.connection import BusConnection, Delivery  # noqa: E402
from ringserve.bus.embedded_server import EmbeddedNatsServer  # noqa: E402
from ringserve.bus.kv_blocks import BLOCK  # noqa: E402
from ringserve.bus.messages import Accepted, RequestOutput, TokenizedRequest  # noqa: E402
from ringserve.bus.params import SamplingParams  # noqa: E402
from ringserve.bus.subjects import Subjects  # noqa: E402


async def first_token(bus: BusConnection, subjects: Subjects, replica: int, rid: str, ids: list[int],
                      peer: int = -1) -> float:
    """Seconds from handing `ids` to `replica` (with `peer` as the holder hint) to its first token; the request
    then runs to its end (4 tokens)."""
    outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()

    async def on_output(out: RequestOutput, delivery: Delivery) -> None:
        await outputs.put(out)

    sub = await bus.subscribe(subjects.output(rid), RequestOutput, on_output)
    request = TokenizedRequest(rid=rid, input_ids=ids, sampling=SamplingParams(max_new_tokens=4, temperature=0),
                               kv_peer=peer, kv_peer_blocks=len(ids) // BLOCK if peer >= 0 else 0)
    started = time.perf_counter()
    await bus.request(subjects.tokenized_for(replica), request, Accepted, 60)
    ttft = None
    while True:
        out = await asyncio.wait_for(outputs.get(), 600)
        if out.error is not None:
            raise RuntimeError(f"{rid}: {out.error.message}")
        if ttft is None and out.token_ids:
            ttft = time.perf_counter() - started
        if out.finish is not None:
            await sub.unsubscribe()
            return ttft if ttft is not None else time.perf_counter() - started


def document(seed: int, tokens: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(tokens)]


def tier_loads(base_url: str) -> int:
    """Replica 0's blocks loaded from its tier since start."""
    replicas = httpx.get(base_url + "/get_server_info", timeout=60).json()["replicas"]
    return next(r["kv_tier_loaded_blocks"] for r in replicas if r["id"] == 0)


async def run(args: argparse.Namespace, nats_url: str, namespace: str, base_url: str) -> dict[str, list[float]]:
    bus = await BusConnection.connect(nats_url, "bench-kv-share")
    subjects = Subjects(namespace)
    times: dict[str, list[float]] = {"fetched": [], "computed": [], "tier": [], "tier computed": []}
    try:
        await first_token(bus, subjects, 0, "warm-0", document(999, 256))
        await first_token(bus, subjects, 1, "warm-1", document(998, 256))
        for trial in range(args.trials):
            for order, mode in enumerate(("fetched", "computed") if trial % 2 == 0 else ("computed", "fetched")):
                doc = document(trial * 10 + order, args.doc_tokens)
                await first_token(bus, subjects, 0, f"hold-{trial}-{order}", doc + [11, 12, 13])
                seconds = await first_token(bus, subjects, 1, f"ask-{trial}-{order}", doc + [21, 22, 23],
                                            peer=0 if mode == "fetched" else -1)
                times[mode].append(seconds)
                print(f"trial {trial} {mode}: {seconds * 1000:.0f} ms", flush=True)
        for trial in range(args.trials):
            doc = document(5000 + trial, args.doc_tokens)
            await first_token(bus, subjects, 0, f"tier-hold-{trial}", doc + [31])
            for k in range(args.evict_docs):  # push it out of the pool into the tier
                await first_token(bus, subjects, 0, f"evict-{trial}-{k}", document(7000 + trial * 50 + k,
                                                                                   args.doc_tokens))
            loads = tier_loads(base_url)
            loaded = await first_token(bus, subjects, 0, f"tier-ask-{trial}", doc + [32])
            if tier_loads(base_url) - loads < args.doc_tokens // BLOCK:
                raise RuntimeError("the evicted document was not loaded from the tier: raise --evict-docs")
            fresh = await first_token(bus, subjects, 0, f"tier-new-{trial}", document(9000 + trial, args.doc_tokens))
            times["tier"].append(loaded)
            times["tier computed"].append(fresh)
            print(f"trial {trial} tier: {loaded * 1000:.0f} ms, computed: {fresh * 1000:.0f} ms", flush=True)
    finally:
        await bus.close()
    return times


def serve_streams(args: argparse.Namespace, server_args: str) -> tuple[float, float]:
    """Generated tokens per second and the median first-token time of `args.streams` concurrent streams of
    distinct prompts on a ring started with `server_args`."""
    server = launch(args.model, server_args)
    try:
        def one(i: int) -> tuple[float, int]:
            body = {"input_ids": document(20000 + i, args.split_prompt), "stream": True,
                    "sampling_params": {"max_new_tokens": args.split_tokens, "temperature": 0, "ignore_eos": True}}
            started, first = time.perf_counter(), None
            with httpx.stream("POST", server.base_url + "/generate", json=body, timeout=600) as reply:
                for line in reply.iter_lines():
                    if line.startswith("data:") and first is None:
                        first = time.perf_counter() - started
            return first or 0.0, args.split_tokens

        one(-1)  # warm
        started = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(args.streams) as pool:
            results = list(pool.map(one, range(args.streams)))
        elapsed = time.perf_counter() - started
        return sum(n for _, n in results) / elapsed, statistics.median(t for t, _ in results)
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--doc-tokens", type=int, default=2048)
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--evict-docs", type=int, default=4, help="documents that push the first out of the pool")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--only-split", action="store_true", help="only the prefill/decode split against one replica")
    parser.add_argument("--split-prompt", type=int, default=512, help="prompt tokens of each split-bench stream")
    parser.add_argument("--split-tokens", type=int, default=32, help="generated tokens of each split-bench stream")
    args = parser.parse_args()
    if args.only_split:
        report_split(args)
        return
    pool = args.doc_tokens * (args.evict_docs - 1)  # holds fewer documents than the trial sends: the first is evicted
    with EmbeddedNatsServer() as nats:
        namespace = "benchkv"
        server = launch(args.model, f"--dp 2 --kv-tier-bytes {2 << 30} --kv-share --max-total-tokens {pool} "
                                    f"--nats-url {nats.url} --namespace {namespace}")
        try:
            times = asyncio.run(run(args, nats.url, namespace, server.base_url))
        finally:
            server.stop()

    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\n{date.today()} on {cpu_name()}; SmolLM2-135M float32, a {args.doc_tokens}-token document, "
          f"{args.trials} trials")
    print(f"second replica's first token: fetched {med['fetched'] * 1000:.0f} ms, computed "
          f"{med['computed'] * 1000:.0f} ms: {med['fetched'] / med['computed']:.2f}x")
    print(f"evicted prefix: loaded from the tier {med['tier'] * 1000:.0f} ms, computed "
          f"{med['tier computed'] * 1000:.0f} ms: {med['tier'] / med['tier computed']:.2f}x")
    report_split(args)


def report_split(args: argparse.Namespace) -> None:
    """The prefill/decode split against one replica doing both, printed."""
    split = serve_streams(args, f"--dp 2 --replica-role prefill,decode --kv-tier-bytes {2 << 30} --kv-share")
    both = serve_streams(args, "--dp 1")
    print(f"{args.streams} streams of {args.split_prompt}-token prompts, {args.split_tokens} tokens each: "
          f"prefill/decode split {split[0]:.1f} tok/s, first token {split[1] * 1000:.0f} ms; one replica "
          f"{both[0]:.1f} tok/s, {both[1] * 1000:.0f} ms: throughput {split[0] / both[0]:.2f}x, first token "
          f"{split[1] / both[1]:.2f}x")


if __name__ == "__main__":
    main()
