"""`--model org/name` resolved from the local Hugging Face cache (offline here): the snapshot `refs/main` names,
served under the hub id; a missing id says where it looked and why it could not download."""

from __future__ import annotations

from pathlib import Path

import pytest

from ringserve.actors.common.hub_cache import is_hub_id
from ringserve.actors.common.model_source import resolve_model
from tests.model_families import tiny_hf_model


def cached_repo(cache: Path, repo_id: str, revision: str) -> Path:
    """A tiny model saved as the hub cache keeps a snapshot of `repo_id` at `revision`."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    tiny_hf_model("qwen3").save_pretrained(snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def test_a_hub_id_resolves_to_its_cached_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    cached_repo(tmp_path, "tiny-org/tiny-qwen3", "0123abcd")
    (tmp_path / "models--tiny-org--tiny-qwen3" / "snapshots" / "old").mkdir()  # an older, incomplete snapshot
    source = resolve_model("tiny-org/tiny-qwen3")
    assert Path(source.directory) == tmp_path / "models--tiny-org--tiny-qwen3" / "snapshots" / "0123abcd"
    assert source.name == "tiny-org/tiny-qwen3" and source.gguf_file is None


def test_a_hub_id_not_cached_offline_says_where_it_looked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match=r"'nobody/none' is not in the local Hugging Face cache \(.*\) and "
                                                r"could not be downloaded \(HF_HUB_OFFLINE is set\)"):
        resolve_model("nobody/none")


def test_paths_are_not_hub_ids(tmp_path: Path) -> None:
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "name").mkdir()
    assert is_hub_id("Qwen/Qwen3-0.6B") and not is_hub_id("model.gguf") and not is_hub_id("/abs/path")
    assert not is_hub_id(str(tmp_path / "org" / "name")) and not is_hub_id("a/b/c")
