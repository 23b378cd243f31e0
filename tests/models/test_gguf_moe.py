"""`--quantization gguf` on mixture-of-experts files: a GGUF written with gguf-py's writer in llama.cpp's layout
(each projection's experts stacked in one tensor, `ffn_gate_exps` `[E, rows, cols]`, a shared expert's own
`ffn_*_shexp` tensors, Q8_0 blocks) fills every expert's fused gate/up and down linear, and the shared expert's,
with exactly the blocks of its slice; the dense layers keep their `ffn_*` tensors. Qwen2-MoE (a dense first
layer, a shared expert) and Qwen3-MoE."""

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
ARCHITECTURES = {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
DENSE = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
         "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp"}


def q8_0(weight: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    """`weight`'s Q8_0 blocks and what they dequantize to."""
    raw = gguf.quants.quantize(weight.detach().float().numpy(), Q8_0)
    return raw, torch.from_numpy(gguf.quants.dequantize(raw, Q8_0))


def write_moe_gguf(family: str, path: Path) -> tuple[dict[str, torch.Tensor], int]:
    """The family's tiny model as a GGUF of Q8_0 blocks; our linears' expected dequantized weights (by our module
    name), and its layer count."""
    hf = tiny_hf_model(family)
    config = hf.config
    writer = gguf.GGUFWriter(str(path), ARCHITECTURES[family])
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    want: dict[str, torch.Tensor] = {}
    dense: dict[str, torch.Tensor] = {}
    state = hf.state_dict()
    for name, weight in state.items():
        if not name.startswith("model.layers.") or not name.endswith(("_proj", "_proj.weight")):
            continue
        layer, suffix = name.removeprefix("model.layers.").split(".", 1)
        prefix = f"model.layers.{layer}"
        if suffix in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):  # stacked [E, rows, cols]
            inner = weight.shape[1] // 2
            parts = ({"ffn_gate_exps": weight[:, :inner], "ffn_up_exps": weight[:, inner:]}
                     if suffix.endswith("gate_up_proj") else {"ffn_down_exps": weight})
            for tensor, stacked in parts.items():
                blocks = [q8_0(expert) for expert in stacked]
                raw = np.stack([b[0] for b in blocks])
                writer.add_tensor(f"blk.{layer}.{tensor}.weight", raw, raw_shape=raw.shape, raw_dtype=Q8_0)
                for e, (_, deq) in enumerate(blocks):
                    ours = f"{prefix}.mlp.experts.{e}.{'down_proj' if tensor == 'ffn_down_exps' else 'gate_up_proj'}"
                    want[ours] = torch.cat([want[ours], deq]) if ours in want else deq
            continue
        module = suffix.removesuffix(".weight")
        raw, deq = q8_0(weight)
        writer.add_tensor(f"blk.{layer}.{DENSE[module]}.weight", raw, raw_shape=raw.shape, raw_dtype=Q8_0)
        dense[f"{prefix}.{module}"] = deq
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for prefix in {name.rsplit(".", 2)[0] if "shared_expert" in name else name.rsplit(".", 1)[0]
                   for name in dense}:
        if f"{prefix}.q_proj" in dense:
            want[f"{prefix}.qkv_proj"] = torch.cat([dense[f"{prefix}.{p}"] for p in ("q_proj", "k_proj", "v_proj")])
            want[f"{prefix}.o_proj"] = dense[f"{prefix}.o_proj"]
    for name in dense:
        if name.endswith("gate_proj"):
            parent = name.removesuffix("gate_proj")
            want[f"{parent}gate_up_proj"] = torch.cat([dense[name], dense[f"{parent}up_proj"]])
            want[f"{parent}down_proj"] = dense[f"{parent}down_proj"]
    return want, config.num_hidden_layers


@pytest.mark.parametrize("family", sorted(ARCHITECTURES))
def test_every_expert_takes_its_slice_of_the_stacked_blocks(family: str, tmp_path: Path) -> None:
    path = tmp_path / f"{family}.gguf"
    want, layers = write_moe_gguf(family, path)
    packed = packed_linears(path, layers, tied_head=True)
    assert "lm_head" not in packed  # the test writes no embedding or head: nothing to pack there
    assert sorted(packed) == sorted(want)
    assert any(".mlp.experts.7.gate_up_proj" in name for name in packed)
    if family == "qwen2_moe":
        assert "model.layers.0.mlp.gate_up_proj" in packed and "model.layers.1.mlp.shared_expert.down_proj" in packed
    for name, weight in want.items():
        torch.testing.assert_close(dequantize(packed[name]), weight, rtol=0, atol=0, msg=name)


def test_a_mixtral_gguf_written_as_llama_is_refused_by_name(tmp_path: Path) -> None:
    """llama.cpp writes Mixtral with `general.architecture` "llama" and `llama.expert_count`: the dense Llama
    family has no place for its experts, so the file is refused saying so, not served wrong."""
    from ringserve.actors.common.model_source import UnservableModel, check_gguf_architecture

    path = tmp_path / "mixtral.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_expert_count(8)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnservableModel, match="mixture-of-experts model written as 'llama' \\(8 experts"):
        check_gguf_architecture(path)
