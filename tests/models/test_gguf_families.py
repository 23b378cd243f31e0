"""`--quantization gguf` reads each family's tensor names: a GGUF written with gguf-py's own writer, llama.cpp's
names and Q8_0 blocks, for Qwen3 (separate q/k/v and gate/up, no q/k row permutation) and Phi-3 (checkpoint-fused
`attn_qkv` and `ffn_up`), packs into our fused linears exactly as the blocks dequantize."""

from __future__ import annotations

from pathlib import Path

import gguf
import gguf.quants
import numpy as np
import pytest
import torch

from ringserve.actors.engine.models.gguf_blocks import packed_linears
from ringserve.kernels.cpu.packing import dequantize
from tests.model_families import tiny_hf_model

Q8_0 = gguf.GGMLQuantizationType.Q8_0
LLAMA_CPP_NAMES = {  # HF module suffix -> llama.cpp tensor of the layer
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
OURS = {"qwen3": {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                  "self_attn.o_proj": ("self_attn.o_proj",), "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
                  "mlp.down_proj": ("mlp.down_proj",)},
        "phi3": {"self_attn.qkv_proj": ("self_attn.qkv_proj",), "self_attn.o_proj": ("self_attn.o_proj",),
                 "mlp.gate_up_proj": ("mlp.gate_up_proj",), "mlp.down_proj": ("mlp.down_proj",)}}


def write_gguf(family: str, path: Path) -> dict[str, torch.Tensor]:
    """The family's tiny model's linears as Q8_0 blocks in a GGUF; returns each HF linear's dequantized weight."""
    hf = tiny_hf_model(family)
    config = hf.config
    writer = gguf.GGUFWriter(str(path), family)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    dequantized: dict[str, torch.Tensor] = {}
    for name, module in hf.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        raw = gguf.quants.quantize(module.weight.detach().numpy().astype(np.float32), Q8_0)
        dequantized[name] = torch.from_numpy(gguf.quants.dequantize(raw, Q8_0))
        if name == "lm_head":
            tensor = "output.weight"
        else:
            layer, suffix = name.removeprefix("model.layers.").split(".", 1)
            tensor = f"blk.{layer}.{LLAMA_CPP_NAMES[suffix]}.weight"
        writer.add_tensor(tensor, raw, raw_shape=raw.shape, raw_dtype=Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dequantized


@pytest.mark.parametrize("family", sorted(OURS))
def test_a_familys_gguf_blocks_fill_our_fused_linears(family: str, tmp_path: Path) -> None:
    path = tmp_path / f"{family}.gguf"
    want = write_gguf(family, path)
    layers = tiny_hf_model(family).config.num_hidden_layers
    packed = packed_linears(path, layers, tied_head=False)
    assert len(packed) == 4 * layers + 1
    for i in range(layers):
        for ours, parts in OURS[family].items():
            expected = torch.cat([want[f"model.layers.{i}.{part}"] for part in parts])
            torch.testing.assert_close(dequantize(packed[f"model.layers.{i}.{ours}"]), expected, rtol=0, atol=0)
    torch.testing.assert_close(dequantize(packed["lm_head"]), want["lm_head"], rtol=0, atol=0)
