"""A GGUF file's own quantized blocks, packed for our CPU group kernels without dequantizing and requantizing.

`--quantization gguf` runs each linear at the precision the file stores it in, as llama.cpp does: every block
type of kernels/cpu/gguf_formats.py (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants Q4_K, Q5_K, Q6_K, as Q4_K_M
and Q5_K_M files mix them) is read as its exact integer codes and scales and repacked for our kernels, never
requantized; a linear stored as floats (F32/F16/BF16) runs its float weights.

Names follow llama.cpp's layout (`blk.{i}.attn_q.weight`, ...), per family as its `ArchSpec.gguf_linears` says
(the file's `general.architecture` picks the family). llama.cpp's converter permutes the rows of Llama's q and k
projections for its rotary layout; transformers undoes it when it loads the file, and so does this module, on the
codes and scales alike (a row permutation leaves the groups along K intact). Our model fuses q/k/v and gate/up:
their blocks are concatenated row-wise in the same order. Mixture-of-experts layers keep their experts stacked
in one tensor per projection (`ffn_gate_exps` `[E, rows, cols]`, ...); each of our experts takes its slice of
the blocks, and a shared expert its own tensors (`ffn_gate_shexp`, ...). The router stays float.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from ringserve.actors.common import startup_cache
from ringserve.actors.common.model_catalog import family_of_gguf
from ringserve.actors.common.model_source import ModelSource, cache_root, gguf_cache_key, publish_directory
from ringserve.actors.engine.models.spec import spec_of
from ringserve.kernels.cpu.gguf_formats import (
    SUPPORTED_GGML_TYPES, BlockCodes, concat_rows, decode_gguf_blocks, pack_by_shape,
)
from ringserve.kernels.cpu.packing import PackedWeight

FLOAT_TYPES = ("F32", "F16", "BF16")  # tensors not stored as blocks
# llama.cpp's names of a mixture-of-experts layer's tensors (every MoE architecture's), as our linears' parts:
# the stacked experts' (our expert e takes slice e) and the shared expert's
GGUF_EXPERTS = {"gate_up_proj": ("ffn_gate_exps", "ffn_up_exps"), "down_proj": ("ffn_down_exps",)}
GGUF_SHARED_EXPERT = {"mlp.shared_expert.gate_up_proj": ("ffn_gate_shexp", "ffn_up_shexp"),
                      "mlp.shared_expert.down_proj": ("ffn_down_shexp",)}
Part = tuple[str, int | None]  # a tensor's name, and the expert whose slice it is (None: the whole tensor)

def rotary_row_order(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's q/k permutation (transformers' `_reverse_permute_weights`)."""
    return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)


class GgufBlocks:
    """The quantized tensors of one GGUF file, by llama.cpp name."""

    def __init__(self, path: str | Path) -> None:
        import gguf

        self.path = str(path)
        reader = gguf.GGUFReader(self.path)
        self._tensors = {t.name: t for t in reader.tensors}
        self.heads = self._field(reader, "attention.head_count")
        self.kv_heads = self._field(reader, "attention.head_count_kv") or self.heads
        architecture = reader.fields["general.architecture"].contents()
        self.spec = spec_of(family_of_gguf(architecture))  # its tensor names and q/k row order

    @staticmethod
    def _field(reader: object, suffix: str) -> int | None:
        for name, field in reader.fields.items():  # type: ignore[attr-defined]
            if name.endswith("." + suffix):
                return int(field.parts[field.data[0]][0])
        return None

    def has(self, name: str) -> bool:
        """Whether the file holds tensor `name`."""
        return name in self._tensors

    def num_experts(self, name: str) -> int:
        """How many experts stacked tensor `name` holds (0 when the file has no such tensor)."""
        tensor = self._tensors.get(name)
        return int(tensor.shape[2]) if tensor is not None and len(tensor.shape) > 2 else 0

    def codes(self, name: str, expert: int | None = None) -> BlockCodes | None:
        """Tensor `name`'s exact codes (of `expert`'s slice, for stacked experts) with llama.cpp's q/k permutation
        undone (Llama's), or None for a tensor stored as floats (F32/F16/BF16: its layer runs the float weights
        transformers read)."""
        tensor = self._tensors[name]
        kind = tensor.tensor_type.name
        if kind in FLOAT_TYPES:
            return None
        if kind not in SUPPORTED_GGML_TYPES:
            raise ValueError(f"{name} is {kind} in {self.path}; --quantization gguf reads "
                             f"{', '.join(SUPPORTED_GGML_TYPES + FLOAT_TYPES)}")
        cols, rows = (int(d) for d in tensor.shape[:2])  # GGML order: the row length first
        data = tensor.data if expert is None else np.asarray(tensor.data).reshape(int(tensor.shape[2]), -1)[expert]
        codes = decode_gguf_blocks(data, kind, rows, cols)
        heads = self.heads if name.endswith("attn_q.weight") else self.kv_heads if name.endswith("attn_k.weight") \
            else None
        if heads and self.spec.gguf_permute_qk:
            codes = codes.permute_rows(rotary_row_order(rows, heads))
        return codes

    def stacked(self, names: tuple[Part, ...]) -> BlockCodes | None:
        """Tensors (or expert slices) `names` stacked row-wise (a fused linear's parts); None when any is stored
        as floats."""
        parts = [self.codes(name, expert) for name, expert in names]
        if any(part is None for part in parts):
            return None
        return concat_rows(parts)  # type: ignore[arg-type]


def packed_linears(path: str | Path, num_layers: int, tied_head: bool) -> dict[str, PackedWeight]:
    """Our model's linear layers (module name -> packed weight) from the GGUF at `path`: every projection of
    every layer, and the LM head (`output.weight`, or the token embedding when the head is tied); a linear whose
    tensors the file stores as floats is left out (it runs its float weights). Each shape's weights share the
    packed form of fewest bytes that holds all of them exactly (the kernel plan runs one form per shape)."""
    blocks = GgufBlocks(path)
    names: dict[str, tuple[Part, ...]] = {}
    for i in range(num_layers):
        for ours, parts in [*blocks.spec.gguf_linears.items(), *GGUF_SHARED_EXPERT.items()]:
            names[f"model.layers.{i}.{ours}"] = tuple((f"blk.{i}.{part}.weight", None) for part in parts)
        for e in range(blocks.num_experts(f"blk.{i}.ffn_gate_exps.weight")):
            for ours, parts in GGUF_EXPERTS.items():
                names[f"model.layers.{i}.mlp.experts.{e}.{ours}"] = tuple((f"blk.{i}.{p}.weight", e) for p in parts)
    names["lm_head"] = (("token_embd.weight" if tied_head else "output.weight", None),)
    # a MoE layer has no dense MLP tensors, a dense one no experts: only what the file holds
    codes = {ours: blocks.stacked(parts) for ours, parts in names.items()
             if all(blocks.has(name) for name, _ in parts)}
    return pack_by_shape({ours: c for ours, c in codes.items() if c is not None})


PACKED_FILE = "blocks.safetensors"
PACKED_VERSION = "3"  # bump when the packed layout changes (2: K-quants as q8_k; 3: q4_k/q5_k/q6_k forms)


def load_packed_linears(source: ModelSource, num_layers: int, tied_head: bool) -> dict[str, PackedWeight]:
    """`packed_linears` of a GGUF model source, through a cache beside the converted float weights (reading
    and repacking a file's blocks takes seconds; the cache loads in milliseconds)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    if source.gguf_file is None:
        raise ValueError(f"--quantization gguf needs a .gguf model; {source.name} is a safetensors checkpoint "
                         "(use int8 or int4)")
    cached = cache_root() / "weights" / f"{gguf_cache_key(source)}-blocks-v{PACKED_VERSION}"
    found = (cached / PACKED_FILE).is_file()
    startup_cache.note("gguf blocks", found)
    if found:
        out: dict[str, PackedWeight] = {}
        with safe_open(str(cached / PACKED_FILE), "pt") as f:
            meta = f.metadata()
            for name in json.loads(meta["linears"]):
                n, k, bits = (int(v) for v in meta[name].split(","))
                mins, wsums = (f.get_tensor(f"{name}.{part}") if f"{name}.{part}" in f.keys() else None
                               for part in ("mins", "wsums"))
                out[name] = PackedWeight(f.get_tensor(f"{name}.qweight"), f.get_tensor(f"{name}.scales"), mins,
                                         n, k, bits, wsums)
        return out
    out = packed_linears(Path(source.directory) / source.gguf_file, num_layers, tied_head)
    tensors: dict[str, torch.Tensor] = {}
    meta = {"linears": json.dumps(sorted(out))}
    for name, p in out.items():
        tensors[f"{name}.qweight"], tensors[f"{name}.scales"] = p.qweight, p.scales
        for part in ("mins", "wsums"):
            if getattr(p, part) is not None:
                tensors[f"{name}.{part}"] = getattr(p, part)
        meta[name] = f"{p.out_features},{p.in_features},{p.bits}"
    cached.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=cached.parent, prefix=".staging-"))
    save_file(tensors, str(staging / PACKED_FILE), metadata=meta)
    publish_directory(staging, cached)
    return out
