"""GPTQ and AWQ checkpoints written by the tests from a tiny float model, as the formats define them.

Each decoder linear's float weight `[N, K]` is quantized to 4-bit codes per group of `group_size` inputs (a scale
and zero per group and output), and the codes written in the format's tensors:

- GPTQ v1 (`gptq`): `qweight` int32 `[K / 8, N]`, eight codes along the inputs per word (code j at bits 4j);
  `qzeros` int32 `[groups, N / 8]`, eight zeros along the outputs per word, each stored one less than it is;
  `scales` fp16 `[groups, N]`; `g_idx` int32 `[K]`, the group of each input.
- GPTQ v2 (`gptq_v2`): the same, the zeros stored as they are.
- AWQ GEMM: `qweight` int32 `[K, N / 8]` and `qzeros` int32 `[groups, N / 8]`, eight values along the outputs per
  word, nibble j holding output `8c + AWQ_ORDER[j]`; `scales` fp16 `[groups, N]`; zeros as they are.

`w = scale * (code - zero)`: the exact dequantization, kept as the float reference model's weight.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
STACKED = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}  # transformers' stacked experts


@dataclass
class Quantized:
    """One linear's codes `[N, K]`, zeros and fp16 scales `[groups, N]`, and the group of each input."""

    codes: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    groups: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """`scale * (code - zero)` per weight, in float32 `[N, K]`."""
        scale = self.scales.float()[self.groups].t()
        zero = self.zeros.float()[self.groups].t()
        return scale * (self.codes.float() - zero)


def desc_act_groups(k: int, group_size: int) -> torch.Tensor:
    """GPTQ `desc_act`'s `g_idx` for `k` inputs: the inputs in an order drawn from `k` alone (every linear of one
    input size shares it, as act-order's from their shared input does), the i-th of them in group i // size."""
    order = torch.randperm(k, generator=torch.Generator().manual_seed(k))
    return torch.empty(k, dtype=torch.int64).index_copy_(0, order, torch.arange(k) // group_size)


def quantize(weight: torch.Tensor, group_size: int, sym: bool, desc_act: bool = False) -> Quantized:
    """`weight` `[N, K]` to 4-bit codes per group of `group_size` inputs (consecutive ones, or `desc_act`'s):
    symmetric (zero 8) or asymmetric (a zero between 1 and 15, which GPTQ v1 stores as zero - 1 in 4 bits)."""
    k = weight.shape[1]
    groups = desc_act_groups(k, group_size) if desc_act else torch.arange(k) // group_size
    columns = weight.float().t()  # [K, N]
    members = [columns[groups == g] for g in range(int(groups.max()) + 1)]  # each [group, N]
    if sym:
        scales = (torch.stack([m.abs().amax(dim=0) for m in members]) / 7.0).half()
        zeros = torch.full_like(scales, 8, dtype=torch.int32)
    else:
        low = torch.stack([m.amin(dim=0) for m in members])
        high = torch.stack([m.amax(dim=0) for m in members])
        scales = ((high - low) / 14.0).half()
        zeros = (-low / scales.float()).round().clamp(1, 15).to(torch.int32)
    codes = (weight.float().t() / scales.float()[groups]).round() + zeros[groups]
    return Quantized(codes.clamp(0, 15).to(torch.int32).t().contiguous(), zeros, scales, groups)


def _words(values: torch.Tensor) -> torch.Tensor:
    """Codes `[..., W, 8]` packed into int32 words `[..., W]`, value j at bits 4j (two's complement)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    word = ((values.to(torch.int64) & 15) << shifts).sum(dim=-1)
    return torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)


def gptq_tensors(q: Quantized, v2: bool = False) -> dict[str, torch.Tensor]:
    """A linear's GPTQ tensors: v1's layout, or `v2`'s (the zeros stored as they are)."""
    k, n = q.codes.shape[1], q.codes.shape[0]
    qweight = _words(q.codes.t().reshape(k // 8, 8, n).permute(0, 2, 1))  # [K / 8, N]
    qzeros = _words((q.zeros - (0 if v2 else 1)).reshape(-1, n // 8, 8))  # [groups, N / 8]
    return {"qweight": qweight, "qzeros": qzeros, "scales": q.scales, "g_idx": q.groups.to(torch.int32)}


def awq_tensors(q: Quantized) -> dict[str, torch.Tensor]:
    """A linear's AWQ GEMM tensors."""
    order = list(AWQ_ORDER)

    def along_outputs(values: torch.Tensor) -> torch.Tensor:  # [rows, N] -> [rows, N / 8]
        return _words(values.reshape(values.shape[0], -1, 8)[..., order])

    return {"qweight": along_outputs(q.codes.t()), "qzeros": along_outputs(q.zeros), "scales": q.scales}


def quantization_config(method: str, group_size: int, sym: bool, desc_act: bool = False) -> dict[str, Any]:
    """The `quantization_config` a GPTQ (method "gptq" or "gptq_v2") or AWQ checkpoint's config.json carries."""
    if method.startswith("gptq"):
        return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "sym": sym, "desc_act": desc_act,
                "checkpoint_format": method}
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}


def write_quantized_checkpoint(hf_model: Any, directory: Path, method: str, group_size: int, sym: bool,
                               desc_act: bool = False) -> dict[str, Quantized]:
    """Save `hf_model` (a saved directory's model, with its tokenizer already there or not) with every decoder
    linear quantized as `method` ("gptq", "gptq_v2" or "awq"), and set each one's float weight in `hf_model` to
    its exact dequantization (the reference); `desc_act`: GPTQ's groups of inputs in act-order. Returns each
    linear's codes by its HF name."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    hf_model.config.save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = quantization_config(method, group_size, sym, desc_act)
    (directory / "config.json").write_text(json.dumps(config))
    tensors: dict[str, torch.Tensor] = {}
    codes: dict[str, Quantized] = {}

    def quantized(name: str, weight: torch.Tensor) -> None:  # `weight` set to its dequantization in place
        q = quantize(weight, group_size, sym, desc_act)
        layout = awq_tensors(q) if method == "awq" else gptq_tensors(q, v2=method == "gptq_v2")
        tensors.update({f"{name}.{part}": t.contiguous() for part, t in layout.items()})
        weight.copy_(q.dequantize())
        codes[name] = q

    with torch.no_grad():
        for name, t in hf_model.state_dict(keep_vars=True).items():
            parent, _, leaf = name.rpartition(".")
            if leaf == "weight" and parent.rpartition(".")[2] in QUANTIZED:
                quantized(parent, t.data)
            elif parent.endswith(".experts") and leaf in STACKED and t.dim() == 3:
                # transformers holds experts stacked; checkpoints store one linear per expert
                for e, weight in enumerate(t.data):
                    pieces = STACKED[leaf]
                    for i, piece in enumerate(pieces):
                        rows = weight.shape[0] // len(pieces)
                        quantized(f"{parent}.{e}.{piece}", weight[i * rows:(i + 1) * rows])
            elif not (name == "lm_head.weight" and hf_model.config.tie_word_embeddings):
                tensors[name] = t.detach().contiguous()
    save_file(tensors, str(directory / "model.safetensors"))
    return codes
