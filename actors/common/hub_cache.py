"""`--model org/name`: a Hugging Face hub id, resolved to a snapshot directory of the local Hugging Face cache
(`HF_HUB_CACHE`, else `HF_HOME/hub`, else ~/.cache/huggingface/hub; layout `models--org--name/snapshots/<rev>`,
the revision `refs/main` names first), or downloaded into it with `huggingface_hub.snapshot_download` (weights,
config and tokenizer files only) where the hub is reachable and `HF_HUB_OFFLINE` is not set, as vLLM and SGLang
do. No torch, no transformers: the launcher resolves `--model` before any actor starts."""

from __future__ import annotations

import os
import re
from pathlib import Path

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
DOWNLOADED = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def is_hub_id(spec: str) -> bool:
    """Whether `spec` reads as `org/name` (and is not a path that exists)."""
    return bool(HUB_ID.match(spec)) and not Path(spec).exists()


def hub_cache_dir() -> Path:
    """Where the Hugging Face cache keeps models, as huggingface_hub finds it."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME")
    return (Path(home).expanduser() if home else Path.home() / ".cache" / "huggingface") / "hub"


def cached_snapshot(repo_id: str, cache: Path | None = None) -> Path | None:
    """The cached snapshot of `repo_id` holding a config.json: `refs/main`'s revision, else the newest one."""
    repo = (cache or hub_cache_dir()) / f"models--{repo_id.replace('/', '--')}"
    snapshots = repo / "snapshots"
    ref = repo / "refs" / "main"
    candidates = []
    if ref.is_file():
        candidates.append(snapshots / ref.read_text().strip())
    if snapshots.is_dir():
        candidates += sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
    return next((c for c in candidates if (c / "config.json").is_file()), None)


def resolve_hub_id(repo_id: str) -> Path:
    """The directory of `repo_id`'s files: cached, else downloaded; FileNotFoundError saying where it looked
    and why it could not download."""
    cache = hub_cache_dir()
    found = cached_snapshot(repo_id, cache)
    if found is not None:
        return found
    why = "HF_HUB_OFFLINE is set"
    if not os.environ.get("HF_HUB_OFFLINE"):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(repo_id, allow_patterns=DOWNLOADED, cache_dir=str(cache)))
        except ImportError:
            why = "huggingface_hub is not installed"
        except Exception as exc:  # no network, no such repo, gated: say which
            why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    raise FileNotFoundError(f"model {repo_id!r} is not in the local Hugging Face cache ({cache}) and could not be "
                            f"downloaded ({why})")
