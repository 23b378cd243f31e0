"""Checkpoints that ship quantized (`quantization_config` in config.json): a method we do not serve is refused by
the launcher in one line naming it and what we serve, before any actor starts; `--quantization` on top of a
checkpoint already quantized is refused, saying why."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.server_helpers import save_tiny_model
from tests.test_docs_claims import ringserve_cmd

UNSERVED = {"bitsandbytes": {"quant_method": "bitsandbytes", "load_in_4bit": True},
            "hqq": {"quant_method": "hqq", "nbits": 4},
            "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128},
            "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}}


@pytest.fixture(scope="module")
def float_directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny float Llama with SmolLM2's tokenizer, saved as a directory."""
    return save_tiny_model(tmp_path_factory.mktemp("float") / "llama", 256)


def with_quantization(source: Path, directory: Path, quantization: dict) -> Path:
    """A copy of the checkpoint `source` whose config.json carries `quantization` as its quantization_config."""
    shutil.copytree(source, directory)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = quantization
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("method", sorted(UNSERVED))
def test_an_unserved_quantization_is_refused_in_one_line(float_directory: Path, tmp_path: Path, method: str) -> None:
    """`ringserve serve` exits before any actor starts: after the progress line saying the model is being read,
    one line naming the checkpoint's method and what is served."""
    directory = with_quantization(float_directory, tmp_path / method, UNSERVED[method])
    done = ringserve_cmd("serve", "--model", str(directory), "--port", "1")
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.splitlines()
    assert len(lines) == 2 and "reading the model" in lines[0], done.stderr
    assert lines[1].startswith(f"ringserve: {directory} is quantized by {method!r}"), done.stderr
    assert "quantized checkpoints served:" in lines[1], done.stderr
    assert "started actor" not in done.stdout + done.stderr
