"""`--quantization gguf`: a GGUF file's own blocks packed for our CPU group kernels as they are (each block type
against gguf-py's dequantization: tests/kernels/test_kernels_cpu_gguf_formats.py).

The q/k row order against transformers' un-permute;
the default model's blocks, fused and un-permuted, dequantizing exactly to the float weights transformers loads
from the same file, through the cache as well; the engine serving on them; a safetensors model refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ringserve.actors.common.model_source import resolve_model
from ringserve.actors.engine.config import EngineConfig
from ringserve.actors.engine.models.gguf_blocks import load_packed_linears, rotary_row_order
from ringserve.kernels.cpu.packing import dequantize

def test_the_rotary_row_order_undoes_llama_cpps_permutation() -> None:
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    rows = np.arange(24 * 2).reshape(24, 2)  # 4 heads of 6 rows
    want = LlamaTensorProcessor()._reverse_permute_weights(rows, 4, 4)
    assert np.array_equal(rows[rotary_row_order(24, 4).numpy()], want)


@pytest.fixture(scope="module")
def smollm2() -> tuple[object, torch.nn.Module]:
    from ringserve.actors.engine.models.weights import load_model

    source = resolve_model("SmolLM2-135M-Instruct")
    return source, load_model(source, torch.float32, "cpu")


def test_the_default_models_blocks_are_exactly_its_weights(smollm2: tuple[object, torch.nn.Module], tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Every projection (q/k un-permuted, q/k/v and gate/up fused) and the tied head (the Q8_0 embedding), read
    from the file, then again from the cache it wrote."""
    source, model = smollm2
    monkeypatch.setenv("RINGSERVE_CACHE", str(tmp_path))
    cfg = model.config  # type: ignore[attr-defined]
    read = load_packed_linears(source, cfg.num_hidden_layers, cfg.tie_word_embeddings)  # type: ignore[arg-type]
    assert list(tmp_path.glob("weights/*-blocks-*/blocks.safetensors"))
    cached = load_packed_linears(source, cfg.num_hidden_layers, cfg.tie_word_embeddings)  # type: ignore[arg-type]
    assert sorted(read) == sorted(cached) and len(read) == 4 * cfg.num_hidden_layers + 1
    assert {p.format for p in read.values()} == {"q4_1", "q8_0"} and read["lm_head"].format == "q8_0"
    for name, packed in cached.items():
        assert torch.equal(packed.qweight, read[name].qweight)
        assert torch.equal(dequantize(packed), model.get_submodule(name).weight), name


def test_the_engine_serves_on_the_files_blocks(smollm2: tuple[object, torch.nn.Module]) -> None:
    from ringserve.actors.common.model_source import load_tokenizer
    from ringserve.actors.engine.scheduling.engine_core import EngineCore
    from ringserve.bus.messages import SamplingParams, TokenizedRequest
    from ringserve.kernels.quantization import QuantLinear

    source, _ = smollm2
    tokenizer = load_tokenizer(source)  # type: ignore[arg-type]
    prompt = tokenizer("The capital of France is")["input_ids"]
    tokens = {}
    for method in ("none", "gguf"):
        engine = EngineCore.from_source(source, EngineConfig(device="cpu", max_total_tokens=2048, quantization=method))
        engine.add_request(TokenizedRequest("r", prompt, SamplingParams(8, temperature=0.0)))
        out: list[int] = []
        while engine.has_work():
            for row in engine.step():
                out += row.token_ids
        tokens[method] = out
        if method == "gguf":
            layers = [m for m in engine.runner.model.modules() if isinstance(m, QuantLinear)]
            assert len(layers) == 4 * 30 + 1 and all(layer.method == "gguf" for layer in layers)
            assert engine.stats().quantization["method"] == "gguf"
    assert len(tokens["gguf"]) == 8 and tokens["gguf"][:4] == tokens["none"][:4], tokens


def test_a_safetensors_model_is_refused(tiny_model_dir: Path) -> None:
    from ringserve.actors.engine.scheduling.engine_core import EngineCore

    with pytest.raises(ValueError, match="needs a .gguf model"):
        EngineCore.from_source(resolve_model(str(tiny_model_dir)), EngineConfig(device="cpu", quantization="gguf"))
