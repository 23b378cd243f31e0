"""LoRA adapters on a quantized GGUF base: SmolLM2's own GGUF (cut to two layers) served with `--quantization
gguf` keeps its blocks in our kernels and runs the adapter in float on top, giving transformers + PEFT's greedy
tokens on the dequantized model."""

from __future__ import annotations

from pathlib import Path

import pytest

from ringserve.actors.common.model_source import resolve_model
from ringserve.actors.engine.config import EngineConfig
from ringserve.actors.engine.scheduling.engine_core import EngineCore
from ringserve.bus.messages import TokenizedRequest
from tests.engine_helpers import greedy, hf_greedy, load_hf_model, run_to_completion, tokens_of
from tests.gguf_files import truncated_gguf
from tests.models.test_lora import make_adapter

PROMPT = [1, 504, 2031, 77, 9001, 311, 42, 1500]
N = 6


def test_a_gguf_base_takes_adapters(tmp_path: Path) -> None:
    source = resolve_model("SmolLM2-135M-Instruct")
    assert source.gguf_file is not None
    two_layers = resolve_model(str(truncated_gguf(Path(source.directory) / source.gguf_file,
                                                  tmp_path / "smollm2-2-layers.gguf", layers=2)))
    hf = load_hf_model(two_layers)  # transformers dequantizes the blocks: the float reference
    peft_model = make_adapter(hf, tmp_path / "adapter", seed=3, r=8)
    expected, base = hf_greedy(peft_model, PROMPT, N, None), hf_greedy(hf, PROMPT, N, None)
    assert expected != base, "the adapter must change the output for the test to mean anything"
    engine = EngineCore.from_source(two_layers, EngineConfig(device="cpu", torch_threads=1, max_total_tokens=2048,
                                                         quantization="gguf",
                                                         lora_modules=f"a={tmp_path / 'adapter'}"))
    assert engine.stats().quantization["method"] == "gguf"  # the base keeps its GGUF blocks
    rows = run_to_completion(engine, [TokenizedRequest("lora", PROMPT, greedy(N, ignore_eos=True, lora_name="a")),
                                      TokenizedRequest("base", PROMPT, greedy(N, ignore_eos=True))])
    assert tokens_of(rows["lora"]) == expected
    assert tokens_of(rows["base"]) == base
