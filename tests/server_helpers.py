"""Start and stop a real `ringserve serve` process for tests, and small HTTP/SSE helpers."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx

from ringserve.bus.embedded_server import free_port

REPO = Path(__file__).resolve().parent.parent


def wait_for(condition: Callable[[], bool], timeout: float = 30.0) -> bool:
    """Poll `condition` every 50 ms until it holds (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def process_alive(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie that no one reaps has exited)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


@dataclass
class ServerHandle:
    """A running ringserve launcher."""

    proc: subprocess.Popen[bytes]
    base_url: str
    nats_url: str | None
    namespace: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def actor_pids(self) -> dict[str, int]:
        """Actor name -> pid, as the launcher logged them."""
        return {name: int(pid) for name, pid in re.findall(r"started actor actor=(\w+) pid=(\d+)", self.log())}

    def live_actors(self) -> list[str]:
        """Actors whose process still exists."""
        alive = []
        for name, pid in self.actor_pids().items():
            try:
                os.kill(pid, 0)
                alive.append(name)
            except ProcessLookupError:
                pass
        return alive

    def stop(self, drain: bool = False) -> int:
        """Ctrl-C the server; unless `drain`, Ctrl-C again until it exits, so streams a test left running do
        not hold the teardown for the launcher's drain period (a second Ctrl-C stops every actor at once)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                # an idle ring is gone within a second; one still draining gets the second Ctrl-C
                self.proc.wait(timeout=30 if drain else 1.5)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGINT)
                try:
                    self.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        return self.proc.returncode


# SmolLM2's context (0.4 GB of KV): a ring's pool is zeroed, so all of it is resident, and with a dozen rings
# alive over the two workers a 24 GiB host ran out of memory at 32768 (1.5 GB each)
TEST_POOL_TOKENS = 8192
PORT_TRIES = 3  # another process may take the free port we picked before the entry binds it


def start_server(model: str, nats_url: str | None = None, extra: list[str] | None = None,
                 timeout: float = 300.0) -> ServerHandle:
    """Launch `ringserve serve` and wait for its ready line; raises with the log if it does not come. A port
    taken by another process before the entry bound it is tried again on another."""
    for attempt in range(PORT_TRIES):
        try:
            return _start_server(model, nats_url, extra, timeout)
        except RuntimeError as exc:
            # taken before the launcher's check (its one line) or before the entry bound it (uvicorn's error)
            if "already in use" not in str(exc) or attempt == PORT_TRIES - 1:
                raise
    raise AssertionError("unreachable")


def _start_server(model: str, nats_url: str | None, extra: list[str] | None, timeout: float) -> ServerHandle:
    port = free_port()
    namespace = f"t{uuid.uuid4().hex[:10]}"
    log_path = Path(tempfile.mkstemp(prefix="ringserve-test-", suffix=".log")[1])
    argv = [sys.executable, "-m", "ringserve.actors.launcher.cli", "serve", "--model", model, "--port", str(port),
            "--namespace", namespace, *(["--nats-url", nats_url] if nats_url else []), *(extra or [])]
    if "--grammar-warm-up" not in argv:  # each ring's warm compile workers hold ~200 MB apiece: only the rings
        argv.append("--no-grammar-warm-up")  # of the tests of the warm-up warm them (many rings run at once)
    if "--max-total-tokens" not in argv:  # SmolLM2's default pool; a tiny model's default is gigabytes of KV, and
        argv += ["--max-total-tokens", str(TEST_POOL_TOKENS)]  # two workers' rings then exhausted CI's memory
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    handle = ServerHandle(proc, f"http://127.0.0.1:{port}", nats_url, namespace, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if "ringserve is ready" in handle.log():
            return handle
        if proc.poll() is not None:
            raise RuntimeError(f"ringserve exited with {proc.returncode} during startup:\n{handle.log()[-4000:]}")
        time.sleep(0.2)
    handle.stop()
    raise TimeoutError(f"ringserve not ready after {timeout}s:\n{handle.log()[-4000:]}")


@contextmanager
def servers_side_by_side(specs: dict[str, tuple[str, list[str]]]) -> Iterator[dict[str, ServerHandle]]:
    """Start one server per `name: (model, extra flags)` at once (a start mostly waits on imports), and stop
    every one that started when the block ends."""
    with ThreadPoolExecutor(len(specs)) as pool:
        futures = {name: pool.submit(start_server, model, extra=extra) for name, (model, extra) in specs.items()}
    try:
        yield {name: future.result() for name, future in futures.items()}
    finally:
        for future in futures.values():
            if future.exception() is None:
                future.result().stop()


def sse_events(response: httpx.Response) -> Iterator[Any]:
    """Decoded `data:` payloads of an SSE response, ending with the string "[DONE]"."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            yield payload if payload == "[DONE]" else json.loads(payload)


def server_info(base_url: str) -> dict[str, Any]:
    return httpx.get(f"{base_url}/get_server_info", timeout=10).json()


def poll_server_info(base_url: str, condition: Any, what: str, timeout: float, interval: float = 0.005) -> dict[str, Any]:
    """Poll /get_server_info until `condition(info)` holds; returns that info, or fails saying `what` it waited
    for once `timeout` seconds passed."""
    deadline = time.monotonic() + timeout
    while True:
        info = server_info(base_url)
        if condition(info):
            return info
        assert time.monotonic() < deadline, f"never saw {what}: {info}"
        time.sleep(interval)


def wait_until_idle(base_url: str, timeout: float = 20.0) -> dict[str, Any]:
    """Poll /get_server_info until no request runs or waits and no KV is held; returns the last info."""
    deadline = time.monotonic() + timeout
    info = server_info(base_url)
    while time.monotonic() < deadline:
        info = server_info(base_url)
        if info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0 and info["kv_running_tokens"] == 0:
            return info
        time.sleep(0.1)
    return info


def save_tiny_model(directory: Path, context_length: int) -> Path:
    """Save a tiny random-weight Llama (safetensors) with the real SmolLM2 tokenizer into `directory`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from ringserve.actors.common.model_source import load_tokenizer, resolve_model

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context_length,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(directory)
    load_tokenizer(resolve_model("SmolLM2-135M-Instruct")).save_pretrained(directory)
    return directory
