"""Start and stop a ringserve for the benchmark (`--launch`), and the few HTTP calls made outside the load."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent


@dataclass
class LaunchedServer:
    """A `ringserve serve` process started by the benchmark, logging to `log_path`."""

    proc: subprocess.Popen[bytes]
    base_url: str
    log_path: Path

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the server's log."""
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        """SIGINT (the launcher then stops every actor); kill after 30 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(model: str, server_args: str = "", timeout: float = 900.0) -> LaunchedServer:
    """Start `ringserve serve --model MODEL SERVER_ARGS` on a free loopback port and wait until it serves.

    Raises RuntimeError (with the log's tail) if it exits or is not ready within `timeout` seconds.
    """
    port = _free_port()
    log_path = Path(tempfile.mkstemp(prefix="ringserve-bench-", suffix=".log")[1])
    argv = [sys.executable, "-m", "ringserve.actors.launcher.cli", "serve", "--model", model, "--host", "127.0.0.1",
            "--port", str(port), "--namespace", f"bench{port}", *shlex.split(server_args)]
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    server = LaunchedServer(proc, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ringserve exited with {proc.returncode} during startup:\n{server.log_tail()}")
        if "ringserve is ready" in server.log_tail(100_000) and ready(server.base_url):
            return server
        time.sleep(0.5)
    server.stop()
    raise RuntimeError(f"ringserve not ready after {timeout:.0f} s:\n{server.log_tail()}")


def ready(base_url: str) -> bool:
    """True when GET /v1/models answers 200."""
    try:
        return httpx.get(f"{base_url.rstrip('/')}/v1/models", timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


def wait_ready(base_url: str, timeout: float) -> None:
    """Poll /v1/models until it answers 200; TimeoutError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not ready(base_url):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{base_url} did not answer /v1/models within {timeout:.0f} s")
        time.sleep(1)


def served_model(base_url: str) -> str:
    """The first model id the server lists."""
    response = httpx.get(f"{base_url.rstrip('/')}/v1/models", timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def flush_cache(base_url: str) -> bool:
    """Ask a ringserve/SGLang server to drop its prefix cache (POST /flush_cache); False where there is none."""
    try:
        return httpx.post(f"{base_url.rstrip('/')}/flush_cache", json={}, timeout=30).status_code == 200
    except httpx.HTTPError:
        return False


def wait_for_decode_graphs(base_url: str, timeout: float) -> dict[str, str]:
    """Wait until no decode graph of a ringserve server is still queued or compiling (compiled CPU graphs build
    in the background as batch sizes first appear); its `decode_graphs` report ({} from other servers). Warns
    about sizes that run eagerly: a figure measured on them is no figure of the compiled server."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            info = httpx.get(f"{base_url.rstrip('/')}/get_server_info", timeout=30).json()
        except (httpx.HTTPError, ValueError):
            return {}
        reports = [r.get("decode_graphs", {}) for r in info.get("replicas") or [info]] if isinstance(info, dict) else []
        pending = [state for report in reports for state in report.values() if state in ("queued", "compiling")]
        if not pending or time.monotonic() > deadline:
            report = reports[0] if reports else {}
            if eager := {size: state for size, state in report.items()
                         if size not in ("mode", "max_bs") and not state.startswith("compiled")}:
                print(f"WARNING: these decode graph sizes run eagerly: {eager}", flush=True)
            return report
        time.sleep(2)
