"""Head-of-line latency (issue 53): a short chat's latency alone and beside a long chat being prefilled.

Each round sends a short chat request (`--short-tokens` new tokens) alone, then starts a long chat (about
`--long-tokens` prompt tokens, new text each round so the prefix cache never answers it), waits until the
scheduler allocated KV for its first chunk (it is being prefilled), and sends the short chat again. Printed per
round and as medians: the short request's latency alone and beside, their ratio, the long prompt's time to
its first token, and whether the short one finished first. `--load N` runs N busy-loop processes through both
phases (a loaded host); `--compiling` launches the ring with its decode graphs compiling in the background
(a private, empty graph store and Inductor cache), the third case of the issue.

    python -m bench.head_of_line --model SmolLM2-135M-Instruct --load 4
    python -m bench.head_of_line --url http://127.0.0.1:8000

Figures are ratios taken side by side in one run: on a shared host only the ratio means anything.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import httpx

from bench.server import launch

BUSY_LOOP = "import time\nend = time.monotonic() + 1800\nwhile time.monotonic() < end:\n    pass\n"
GUARD = 600.0  # a hang, not a measurement


def chat(base: str, model: str, content: str, max_tokens: int) -> dict[str, Any]:
    """One non-streamed chat completion; the JSON body (raises on an HTTP error)."""
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0}
    response = httpx.post(base + "/v1/chat/completions", json=body, timeout=GUARD)
    response.raise_for_status()
    return response.json()


def long_text(base: str, model: str, tokens: int, nonce: int) -> str:
    """About `tokens` tokens of chat text that starts with `nonce` (no prefix shared with other rounds)."""
    words = " ".join(f"w{(nonce * 7919 + i * 31) % 9973}" for i in range(tokens))
    reply = httpx.post(base + "/v1/tokenize", json={"model": model, "prompt": words}, timeout=GUARD).json()
    per_word = max(1.0, len(reply["tokens"]) / tokens)
    return f"Round {nonce}. Summarise: " + " ".join(words.split()[:int(tokens / per_word)])


def server_info(base: str) -> dict[str, Any]:
    info = httpx.get(base + "/get_server_info", timeout=GUARD).json()
    return (info.get("replicas") or [info])[0]


def stream_first_token(base: str, model: str, content: str, out: dict[str, Any]) -> None:
    """Stream a long chat (2 new tokens) and record when its first token came (`out["first"]`); an abort ends
    the stream early."""
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 2,
            "temperature": 0, "stream": True}
    try:
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=GUARD) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and '"content"' in line and "first" not in out:
                    out["first"] = time.monotonic()
    except httpx.HTTPError:
        pass  # an aborted stream may end without its last chunk
    out["done"] = time.monotonic()


def short_latency(base: str, model: str, short_tokens: int) -> tuple[float, float]:
    """(seconds, when it ended) of one short chat."""
    started = time.monotonic()
    chat(base, model, "Say hello.", short_tokens)
    ended = time.monotonic()
    return ended - started, ended


def round_beside(base: str, model: str, text: str, short_tokens: int, finish_long: bool) -> dict[str, float]:
    """The short chat sent while `text` is being prefilled: its latency, the long one's TTFT (0 when it was
    aborted after the short one ended, unless `finish_long`), the order."""
    out: dict[str, Any] = {}
    before = server_info(base)["kv_used_tokens"]
    started = time.monotonic()
    thread = threading.Thread(target=stream_first_token, args=(base, model, text, out))
    thread.start()
    deadline = time.monotonic() + GUARD
    while server_info(base)["kv_used_tokens"] <= before and "first" not in out:  # its first chunk is in
        assert time.monotonic() < deadline, "the long prompt never started prefilling"
        time.sleep(0.02)
    sent = time.monotonic() - started
    latency, ended = short_latency(base, model, short_tokens)
    short_first = "first" not in out
    if short_first and not finish_long:  # the order is known: end the long prompt (this bench's only request)
        httpx.post(base + "/abort_request", json={"abort_all": True}, timeout=GUARD).raise_for_status()
    thread.join(GUARD)
    first = out.get("first")
    return {"short": latency, "long_ttft": first - started if first else 0.0, "sent_after": sent,
            "short_first": float(short_first)}


def run(base: str, model: str, rounds: int, long_tokens: int, short_tokens: int, finish_long: bool) -> None:
    short_latency(base, model, short_tokens)  # warm: the first request after a start pays for imports
    alone, beside = [], []
    for i in range(rounds):
        text = long_text(base, model, long_tokens, nonce=int(time.time()) % 100000 + i)
        alone.append(short_latency(base, model, short_tokens)[0])
        r = round_beside(base, model, text, short_tokens, finish_long)
        beside.append(r["short"])
        ttft = f"long TTFT {r['long_ttft']:.2f} s" if r["long_ttft"] else "long prompt aborted"
        print(f"round {i}: alone {alone[-1]:.2f} s, beside {r['short']:.2f} s (sent {r['sent_after']:.2f} s after "
              f"the long one), {ttft}, short finished "
              f"{'first' if r['short_first'] else 'AFTER the long prompt'}", flush=True)
    a, b = statistics.median(alone), statistics.median(beside)
    print(f"short request median: alone {a:.2f} s, beside a {long_tokens}-token prompt {b:.2f} s, "
          f"ratio {b / a:.1f}x", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server (default: launch one)")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="the model to launch")
    parser.add_argument("--server-args", default="", help="more `ringserve serve` flags for the launched ring")
    parser.add_argument("--compiling", action="store_true",
                        help="launch with CPU decode graphs compiling (empty graph store and Inductor cache)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--long-tokens", type=int, default=7000)
    parser.add_argument("--short-tokens", type=int, default=4)
    parser.add_argument("--load", type=int, default=0, help="busy-loop processes beside the ring")
    parser.add_argument("--finish-long", action="store_true",
                        help="let each long prompt finish (its TTFT) instead of aborting it once the short one ended")
    args = parser.parse_args()
    hogs: list[subprocess.Popen[bytes]] = []
    server = None
    try:
        if args.url:
            base = args.url.rstrip("/")
        else:
            if args.compiling:
                scratch = tempfile.mkdtemp(prefix="hol-graphs-")
                os.environ.update(RINGSERVE_CPU_GRAPHS="1", RINGSERVE_GRAPH_STORE="0",
                                  TORCHINDUCTOR_CACHE_DIR=scratch)
            server = launch(args.model, args.server_args)
            base = server.base_url
        model = httpx.get(base + "/v1/models", timeout=GUARD).json()["data"][0]["id"]
        hogs = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(args.load)]
        if hogs:
            time.sleep(2)  # the loops are running before the first figure
        print(f"model {model}, load {args.load} busy loops, os.getloadavg {os.getloadavg()[0]:.1f}", flush=True)
        run(base, model, args.rounds, args.long_tokens, args.short_tokens, args.finish_long)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
        if server is not None:
            server.stop()
            print(f"server log: {server.log_path}")


if __name__ == "__main__":
    main()
