"""The kernel-plan cache (kernels/linear_plan/cache.py): measurements stored per host key and read back; one
measured on a busy host is measured again once the host is quiet, and kept while it is busy."""

from __future__ import annotations

from pathlib import Path

import pytest

from ringserve.kernels.linear_plan import cache as plan_cache

KEY = plan_cache.host_key({"test": "plan cache"})
RESULT = {"times": {"8,8,1": {"float32": 1e-6}}}


def _measured_at(load: float, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plan_cache, "load_per_core", lambda: load)
    assert plan_cache.store(KEY, RESULT) is not None


def test_a_plan_is_read_back_under_its_key_only(plan_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _measured_at(0.1, monkeypatch)
    assert plan_cache.load(KEY) == RESULT
    assert plan_cache.load({**KEY, "test": "another"}) is None
    monkeypatch.setenv("RINGSERVE_KERNEL_PLAN_CACHE", "0")
    assert plan_cache.load(KEY) is None


@pytest.mark.parametrize("now, read_back", [(0.2, False), (1.4, True)])
def test_a_plan_measured_on_a_busy_host_is_measured_again_once_it_is_quiet(
        now: float, read_back: bool, plan_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _measured_at(2 * plan_cache.BUSY_LOAD, monkeypatch)
    monkeypatch.setattr(plan_cache, "load_per_core", lambda: now)
    assert (plan_cache.load(KEY) == RESULT) is read_back


def test_a_plan_measured_on_a_quiet_host_is_kept_when_it_is_busy(plan_dir: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    _measured_at(0.3, monkeypatch)
    monkeypatch.setattr(plan_cache, "load_per_core", lambda: 3.0)
    assert plan_cache.load(KEY) == RESULT
