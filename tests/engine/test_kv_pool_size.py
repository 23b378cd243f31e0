"""The default KV pool size is stable across starts: it follows MemTotal (or the cgroup limit), not MemAvailable,
never takes more than fits, and `/get_server_info` says how it was chosen."""

from __future__ import annotations

from pathlib import Path

from ringserve.actors.common.memory_limits import available_memory
from ringserve.actors.engine.config import EngineConfig, stable_pool_tokens

PER_TOKEN = 46080  # SmolLM2-135M float32 K+V per token
GIB = 1 << 30


def _meminfo(tmp_path: Path, total: int, available: int) -> Path:
    path = tmp_path / f"meminfo-{available}"
    path.write_text(f"MemTotal:       {total // 1024} kB\nMemFree: 1 kB\nMemAvailable:   {available // 1024} kB\n")
    return path


def _plan(tmp_path: Path, total: int, available: int) -> tuple[int, dict[str, str]]:
    budget = available_memory(tmp_path / "no-cgroup", tmp_path / "no-self-cgroup", _meminfo(tmp_path, total, available))
    return EngineConfig(device="cpu").kv_pool_plan(PER_TOKEN, context_length=8192, memory=budget)


def test_two_memavailable_readings_give_one_size(tmp_path: Path) -> None:
    # the host: 36,864 tokens at one start and 49,152 at the next, from 10% of MemAvailable
    first, report = _plan(tmp_path, 16 * GIB, int(36864 * PER_TOKEN / 0.1))
    second, _ = _plan(tmp_path, 16 * GIB, int(49152 * PER_TOKEN / 0.1))
    assert first == second == 32768  # 0.1 * 16 GiB / 46080 = 37,282 -> 32,768
    assert report["sized_from"] == "0.1 of host MemTotal"
    assert report["tokens"] == "32768" and report["halved_to_fit"] == "0"
    assert int(report["total_bytes"]) == 16 * GIB


def test_never_more_than_fits(tmp_path: Path) -> None:
    # 1 GiB available: at most half of it, 11,650 tokens -> halved from 32,768 twice to 8,192
    tokens, report = _plan(tmp_path, 16 * GIB, 1 * GIB)
    assert tokens * PER_TOKEN <= GIB // 2
    assert tokens == 8192 and report["halved_to_fit"] == "2"


def test_cgroup_limit_is_the_total_in_a_container(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    root.mkdir()
    (root / "cgroup.controllers").write_text("memory\n")
    (root / "memory.max").write_text(str(2 * GIB))
    (root / "memory.current").write_text(str(GIB // 4))
    budget = available_memory(root, tmp_path / "none", _meminfo(tmp_path, 64 * GIB, 40 * GIB))
    tokens, report = EngineConfig(device="cpu").kv_pool_plan(PER_TOKEN, 8192, memory=budget)
    assert report["sized_from"] == "0.1 of cgroup v2 limit"
    assert tokens == 4096  # 0.1 * 2 GiB / 46080 = 4,660 -> 4,096


def test_power_of_two_steps_and_the_running_requests_cap() -> None:
    assert stable_pool_tokens(100_000 * 10, 10**12, 10, cap=10**9) == (65536, 0)
    assert stable_pool_tokens(100_000 * 10, 10**12, 10, cap=5000) == (5000, 0)
    assert stable_pool_tokens(10, 0, 100, cap=10) == (1, 0)


def test_an_explicit_size_is_reported_as_such() -> None:
    tokens, report = EngineConfig(max_total_tokens=1000).kv_pool_plan(PER_TOKEN, 8192)
    assert tokens == 1000 and report["sized_from"] == "--max-total-tokens"


def test_server_info_says_how_the_pool_was_sized(hf: object) -> None:
    from dataclasses import asdict

    from tests.engine_helpers import engine_for

    engine = engine_for(hf, max_total_tokens=0, max_running_requests=2)  # capped: 2 x context, a small pool
    info = asdict(engine.stats())  # what /get_server_info returns beside the replicas
    assert info["kv_pool"]["sized_from"].endswith(("host MemTotal", "limit"))
    assert int(info["kv_pool"]["tokens"]) == info["kv_total_tokens"]
