"""Images through the ring: requests per second at 8 streams, the tokenizer actor's CPU per image, and the bytes
of the request messages with image handles against the images inline.

    .venv/bin/python bench/bench_images.py [--streams 8] [--requests 64] [--side 640] [--tokens 8]

A ring (`ringserve serve`, its own processes) serves the tiny LLaVA of tests/vision_models.py (a CLIP tower on
32x32 images, so the model's share is small and the ring's image path dominates) on a NATS server this script
also subscribes to. Each stream sends chat completions with one `image_url` data URL each: a distinct
`--side` x `--side` JPEG photo-like image per request (decoded, resized and normalised by the model's processor in
the tokenizer), then the same requests without an image for the baseline. The tokenizer's CPU is read from
/proc before and after each phase; its CPU per image is the difference of the two phases per request.
Message bytes are those seen on `{ns}.req.submit` and `{ns}.req.tokenized` per request; inline they would carry
the image file's base64 (a data URL) and the processed tensors (`ImageRef.nbytes`) instead of the handles.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import os
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

import httpx
import nats
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_moe import cpu_name  # noqa: E402


def photo(side: int, seed: int) -> bytes:
    """A smooth, photo-like JPEG (gradients and noise), about what a camera image compresses to."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:side, 0:side] / side
    channels = [np.sin(x * rng.uniform(2, 9) + y * rng.uniform(2, 9) + rng.uniform(0, 6)) for _ in range(3)]
    pixels = (np.stack(channels, -1) * 100 + 128 + rng.normal(0, 12, (side, side, 3))).clip(0, 255)
    out = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(out, format="JPEG", quality=90)
    return out.getvalue()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def phase(url: str, bodies: list[dict[str, Any]], streams: int) -> float:
    """Send `bodies` over `streams` concurrent streams; the seconds it took."""
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for body in bodies:
        queue.put_nowait(body)

    async def stream(http: httpx.AsyncClient) -> None:
        while not queue.empty():
            reply = await http.post(f"{url}/v1/chat/completions", json=queue.get_nowait())
            reply.raise_for_status()

    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=300) as http:
        await asyncio.gather(*(stream(http) for _ in range(streams)))
    return time.perf_counter() - started


async def measure(server: Any, nats_url: str, args: argparse.Namespace) -> dict[str, Any]:
    from ringserve.bus.codec import decode, encode
    from ringserve.bus.messages import GenerateRequest, TokenizedRequest

    images = [photo(args.side, seed) for seed in range(args.requests)]
    urls = [f"data:image/jpeg;base64,{base64.b64encode(image).decode()}" for image in images]

    def body(url: str | None) -> dict[str, Any]:
        content: list[dict[str, Any]] = [{"type": "text", "text": "Describe this picture."}]
        if url is not None:
            content.insert(0, {"type": "image_url", "image_url": {"url": url}})
        return {"messages": [{"role": "user", "content": content}], "max_tokens": args.tokens, "temperature": 0}

    nc = await nats.connect(nats_url)
    sizes: dict[str, list[int]] = {"submit": [], "tokenized": [], "submit_inline": [], "tokenized_inline": []}

    async def record(msg: Any) -> None:
        kind = msg.subject.split(".")[2]
        sizes[kind].append(len(msg.data))
        if kind == "submit":  # inline: the data URL where the handle is
            req = decode(msg.data, GenerateRequest)
            for turn in req.messages or []:
                for part in turn.parts or []:
                    if part.get("type") == "image":
                        part["handle"] = urls[0]  # the same size class as each request's own
            sizes["submit_inline"].append(len(encode(req)))
        elif kind == "tokenized":
            tokenized = decode(msg.data, TokenizedRequest)
            extra = sum(ref.nbytes - len(ref.handle) for ref in tokenized.images)
            sizes["tokenized_inline"].append(len(msg.data) + extra)

    sub = await nc.subscribe(f"{server.namespace}.req.>", cb=record)
    tokenizer = server.actor_pids()["tokenizer0"]
    await phase(server.base_url, [body(urls[0]), body(None)], 2)  # warm: the processor, the store, the graphs
    for key in sizes:
        sizes[key].clear()
    cpu0 = cpu_seconds(tokenizer)
    with_images = await phase(server.base_url, [body(url) for url in urls], args.streams)
    cpu1 = cpu_seconds(tokenizer)
    await nc.flush()
    image_sizes = {key: list(values) for key, values in sizes.items()}
    text_only = await phase(server.base_url, [body(None) for _ in urls], args.streams)
    cpu2 = cpu_seconds(tokenizer)
    await sub.unsubscribe()
    await nc.close()
    n = args.requests
    return {"image_rps": n / with_images, "text_rps": n / text_only,
            "cpu_per_image_ms": ((cpu1 - cpu0) - (cpu2 - cpu1)) / n * 1000,
            "cpu_per_image_request_ms": (cpu1 - cpu0) / n * 1000, "cpu_per_text_request_ms": (cpu2 - cpu1) / n * 1000,
            "image_file_bytes": int(np.mean([len(i) for i in images])),
            **{f"{key}_bytes": int(np.mean(values)) for key, values in image_sizes.items() if values}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--side", type=int, default=640, help="the images' width and height in pixels")
    parser.add_argument("--tokens", type=int, default=8, help="tokens generated per request")
    args = parser.parse_args()

    from ringserve.bus.embedded_server import EmbeddedNatsServer
    from tests.server_helpers import start_server
    from tests.vision_models import save_tiny_vlm

    with tempfile.TemporaryDirectory() as directory, EmbeddedNatsServer() as nats_server:
        model = save_tiny_vlm("llava", Path(directory))
        server = start_server(str(model), nats_url=nats_server.url)
        try:
            result = asyncio.run(measure(server, nats_server.url, args))
        finally:
            server.stop()
    print(f"{date.today()} on {cpu_name()} ({os.cpu_count()} CPUs); tiny LLaVA, {args.streams} streams, "
          f"{args.requests} requests, {args.side}x{args.side} JPEG ({result['image_file_bytes']} bytes), "
          f"{args.tokens} tokens each")
    for key, value in result.items():
        print(f"  {key}: {value:.2f}" if isinstance(value, float) else f"  {key}: {value}")


if __name__ == "__main__":
    main()
