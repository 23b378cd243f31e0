"""Shared fixtures: a real NATS server, a real ringserve serving SmolLM2-135M-Instruct, transformers' SmolLM2 as
the greedy reference, a tiny model (saved for a whole ring, or as a transformers model for engine tests), and
torch on one thread in this process."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from ringserve.bus.embedded_server import EmbeddedNatsServer
from tests.host_lock import LOCKS_ENV, host_share
from tests.otlp_receiver import OtlpReceiver
from tests.server_helpers import ServerHandle, save_tiny_model, start_server
from tests.shared_rings import logged, start_clients_ring, start_small_ring

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
# A hog ends itself after 5 minutes should this process die before it kills the hog.
CPU_HOG = "import time\nend = time.monotonic() + 300\nwhile time.monotonic() < end:\n    pass\n"
# Servers the tests start serve eagerly on a CPU: compiling decode graphs in the background would cost each of
# them a minute of CPU (tests/engine/test_decode_graph_compile.py compiles in-process instead).
os.environ.setdefault("RINGSERVE_CPU_GRAPHS", "0")
# Where a test does compile, a size whose graph fails is an error, never a silent eager fallback.
os.environ.setdefault("RINGSERVE_GRAPH_FALLBACK", "error")


def pytest_configure(config: pytest.Config) -> None:
    """The controller makes the host lock's directory (tests/host_lock.py); xdist workers inherit it."""
    if "PYTEST_XDIST_WORKER" not in os.environ and LOCKS_ENV not in os.environ:
        os.environ[LOCKS_ENV] = tempfile.mkdtemp(prefix="ringserve-test-locks-")
        config.add_cleanup(lambda: shutil.rmtree(os.environ.pop(LOCKS_ENV), ignore_errors=True))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Each test (its setup and teardown too) holds the host: alone when marked `host_load`."""
    if "PYTEST_XDIST_WORKER" not in os.environ or LOCKS_ENV not in os.environ:
        yield  # one process runs the tests: nothing runs beside them
        return
    with host_share(os.environ[LOCKS_ENV], exclusive=item.get_closest_marker("host_load") is not None):
        yield


@pytest.fixture
def cpu_hogs(request: pytest.FixtureRequest) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Two processes spinning on the CPU (this machine's two cores and then some: a load average of 4+), for a
    test marked `host_load` (so that no other test runs beside them)."""
    if request.node.get_closest_marker("host_load") is None:
        raise pytest.UsageError(f"{request.node.nodeid} uses cpu_hogs: mark it host_load")
    hogs = [subprocess.Popen([sys.executable, "-c", CPU_HOG]) for _ in range(2)]
    try:
        yield hogs
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


@pytest.fixture
def plan_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Kernel plans and float32 GEMV choices a test measures go to a temporary cache (`RINGSERVE_CACHE`)."""
    monkeypatch.setenv("RINGSERVE_CACHE", str(tmp_path))
    return tmp_path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model with a 4096-token context: a whole ring starts in seconds."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), 4096)


@pytest.fixture(autouse=True, scope="module")
def torch_single_thread() -> Iterator[None]:
    """Run each test module's in-process torch work on one thread.

    On a small shared machine two OpenMP threads competing with other processes spin at barriers and run
    tiny matmuls tens of times slower; one thread keeps the engine tests fast and their timing stable.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(autouse=True, scope="module")
def end_idle_compile_workers() -> Iterator[None]:
    """After each module, end the grammar compile workers its in-process engines left idle (about 200 MB each:
    kept to the session's end, they added up to gigabytes in each pytest worker)."""
    yield
    from ringserve.kernels.grammar.compile_pool import shed_idle_workers

    shed_idle_workers()


@pytest.fixture(scope="module")
def hf() -> Any:
    """A tiny random transformers Llama (tests/engine_helpers.py `tiny_hf_llama`), the engine tests' reference."""
    from tests.engine_helpers import tiny_hf_llama  # imported late: test_kernels_triton sets its env first

    return tiny_hf_llama()


@pytest.fixture(scope="session")
def smollm_hf() -> Any:
    """transformers' own SmolLM2-135M-Instruct (float32, CPU, eval mode), loaded once for the session: the greedy
    reference that the engine, server and tensor-parallel tests compare against (loading it takes seconds)."""
    from ringserve.actors.common.model_source import resolve_model
    from tests.engine_helpers import load_hf_model

    return load_hf_model(resolve_model(DEFAULT_MODEL))


@pytest.fixture(scope="session")
def nats_server() -> Iterator[EmbeddedNatsServer]:
    with EmbeddedNatsServer() as server:
        yield server


@pytest.fixture(scope="session")
def smollm_server(nats_server: EmbeddedNatsServer) -> Iterator[ServerHandle]:
    """The real model behind the whole ring, on a NATS server the tests can also talk to directly."""
    handle = start_server(DEFAULT_MODEL, nats_url=nats_server.url)
    yield handle
    assert len(handle.actor_pids()) == 4  # scheduler, tokenizer, detokenizer, entry: separate processes
    code = handle.stop()  # Ctrl-C
    assert code == 0, f"ringserve exited with {code} on Ctrl-C:\n{handle.log()[-3000:]}"
    assert handle.live_actors() == [], "Ctrl-C left actor processes running"


@pytest.fixture(scope="session")
def overlap_shards_server(nats_server: EmbeddedNatsServer) -> Iterator[ServerHandle]:
    """SmolLM2 with the engine's overlap loop forced on, two detokenizer shards and `--stream-interval 3`, on the
    session's NATS server: shared by the overlap-loop, elastic-detokenizer and stream-interval tests (no flag
    changes what the others test)."""
    handle = start_server(DEFAULT_MODEL, nats_url=nats_server.url,
                          extra=["--overlap-schedule", "on", "--detokenizer-shards", "2", "--stream-interval", "3"])
    yield handle
    assert handle.stop() == 0, handle.log()[-3000:]


@pytest.fixture(scope="session")
def clients_ring(tiny_model_dir: Path) -> Iterator[ServerHandle]:
    """The tiny model on a ring with NATS client users (tests/shared_rings.py `start_clients_ring`), shared by
    the client-flood, NATS-auth and `ringserve.Client` tests; its credentials go with the launcher."""
    handle = start_clients_ring(tiny_model_dir)
    creds_dir = Path(logged(handle, r"nats per-role users credentials_dir=(\S+)"))
    yield handle
    assert handle.stop() == 0, handle.log()[-3000:]
    assert not creds_dir.exists(), "the credentials directory outlived the launcher"


@pytest.fixture(scope="session")
def small_ring_spans() -> Iterator[OtlpReceiver]:
    """The OTLP/HTTP receiver the small ring exports its spans to."""
    with OtlpReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="session")
def small_ring(tiny_model_dir: Path, small_ring_spans: OtlpReceiver) -> Iterator[ServerHandle]:
    """The tiny model on a ring with a bounded queue, a body-read timeout, small prefill chunks and tracing to
    `small_ring_spans` (tests/shared_rings.py `start_small_ring`), shared by the backpressure, upload, fairness
    and tracing tests."""
    handle = start_small_ring(tiny_model_dir, small_ring_spans.url)
    yield handle
    assert handle.stop() == 0, handle.log()[-3000:]
