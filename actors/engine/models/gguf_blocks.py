"""A GGUF file's own quantized blocks, packed for our CPU group kernels without dequantizing and requantizing.

`--quantization gguf` runs each linear at the precision the file stores it in, as llama.cpp does: Q8_0, Q4_0
and Q4_1 blocks (32 weights with an fp16 scale, and for Q4_1 an fp16 min) are exactly the formats of
`ringserve.kernels.cpu.packing`, so their integer codes and scales are repacked into the kernels' tiled layout as they
are. Other block types (K-quants, F16, ...) are not read here: `packed_linears` names them in its error.

Names follow llama.cpp's layout (`blk.{i}.attn_q.weight`, ...), per family as its `ArchSpec.gguf_linears` says
(the file's `general.architecture` picks the family). llama.cpp's converter permutes the rows of Llama's q and k
projections for its rotary layout; transformers undoes it when it loads the file, and so does this module, on the
codes and scales alike (a row permutation leaves the groups along K intact). Our model fuses q/k/v and gate/up:
their blocks are concatenated row-wise in the same order.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from ringserve.actors.common.model_source import ModelSource, cache_root, gguf_cache_key, publish_directory
from ringserve.actors.engine.models.registry import family_of_gguf, spec_of
from ringserve.kernels.cpu.packing import QK, PackedWeight, pack_codes

BLOCK_FORMATS = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1"}  # GGML type -> kernels.cpu.packing format
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}  # per 32 weights: fp16 scale (and min), then the codes


def decode_blocks(raw: np.ndarray, fmt: str, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                             torch.Tensor | None]:
    """A quantized GGUF tensor's bytes `[rows, cols / 32 * block bytes]` as integer codes `[rows, cols]`
    (q8_0: int8; q4_x: 0..15), fp16 scales `[rows, cols / 32]` and, for q4_1, fp16 mins."""
    if cols % QK:
        raise ValueError(f"a {fmt} tensor of {cols} columns: not whole blocks of {QK}")
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // QK, BLOCK_BYTES[fmt])
    scales = torch.from_numpy(blocks[:, :, 0:2].copy().view(np.float16)[..., 0])
    if fmt == "q8_0":
        codes = torch.from_numpy(blocks[:, :, 2:].copy().view(np.int8)).reshape(rows, cols)
        return codes, scales, None
    start = 4 if fmt == "q4_1" else 2
    mins = torch.from_numpy(blocks[:, :, 2:4].copy().view(np.float16)[..., 0]) if fmt == "q4_1" else None
    qs = torch.from_numpy(blocks[:, :, start:].copy())  # [rows, blocks, 16]: weight j low nibble, j + 16 high
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(rows, cols)
    return codes, scales, mins


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

    def format_of(self, name: str) -> str | None:
        """The packing format of tensor `name` ("q8_0", "q4_0", "q4_1"), None when it has another type."""
        tensor = self._tensors.get(name)
        return None if tensor is None else BLOCK_FORMATS.get(tensor.tensor_type.name)

    def codes(self, name: str) -> tuple[str, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(format, codes, scales, mins) of tensor `name` with llama.cpp's q/k permutation undone."""
        tensor = self._tensors[name]
        fmt = self.format_of(name)
        if fmt is None:
            raise ValueError(f"{name} is {tensor.tensor_type.name} in {self.path}; --quantization gguf reads "
                             f"{', '.join(BLOCK_FORMATS)} blocks only")
        cols, rows = (int(d) for d in tensor.shape[:2])  # GGML order: the row length first
        codes, scales, mins = decode_blocks(tensor.data, fmt, rows, cols)
        heads = self.heads if name.endswith("attn_q.weight") else self.kv_heads if name.endswith("attn_k.weight") \
            else None
        if heads and self.spec.gguf_permute_qk:
            order = rotary_row_order(rows, heads)
            codes, scales = codes[order], scales[order]
            mins = mins[order] if mins is not None else None
        return fmt, codes, scales, mins

    def packed(self, names: tuple[str, ...]) -> PackedWeight:
        """Tensors `names` (one format) stacked row-wise and packed for the group kernels."""
        parts = [self.codes(name) for name in names]
        formats = {fmt for fmt, *_ in parts}
        if len(formats) != 1:
            raise ValueError(f"{', '.join(names)} mix block types {sorted(formats)}: they cannot be fused")
        mins = [m for *_, m in parts]
        return pack_codes(torch.cat([c for _, c, _, _ in parts]), torch.cat([s for _, _, s, _ in parts]),
                          torch.cat(mins) if mins[0] is not None else None, formats.pop())


def packed_linears(path: str | Path, num_layers: int, tied_head: bool) -> dict[str, PackedWeight]:
    """Our model's linear layers (module name -> packed weight) from the GGUF at `path`: every projection of
    every layer, and the LM head (`output.weight`, or the token embedding when the head is tied)."""
    blocks = GgufBlocks(path)
    out = {f"model.layers.{i}.{ours}": blocks.packed(tuple(f"blk.{i}.{part}.weight" for part in parts))
           for i in range(num_layers) for ours, parts in blocks.spec.gguf_linears.items()}
    head = "token_embd.weight" if tied_head else "output.weight"
    out["lm_head"] = blocks.packed((head,))
    return out


PACKED_FILE = "blocks.safetensors"
PACKED_VERSION = "1"  # bump when the packed layout changes


def load_packed_linears(source: ModelSource, num_layers: int, tied_head: bool) -> dict[str, PackedWeight]:
    """`packed_linears` of a GGUF model source, through a cache beside the converted float weights (reading
    and repacking a file's blocks takes seconds; the cache loads in milliseconds)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    if source.gguf_file is None:
        raise ValueError(f"--quantization gguf needs a .gguf model; {source.name} is a safetensors checkpoint "
                         "(use int8 or int4)")
    cached = cache_root() / "weights" / f"{gguf_cache_key(source)}-blocks-v{PACKED_VERSION}"
    if (cached / PACKED_FILE).is_file():
        out: dict[str, PackedWeight] = {}
        with safe_open(str(cached / PACKED_FILE), "pt") as f:
            meta = f.metadata()
            for name in json.loads(meta["linears"]):
                n, k, bits = (int(v) for v in meta[name].split(","))
                mins = f.get_tensor(f"{name}.mins") if f"{name}.mins" in f.keys() else None
                out[name] = PackedWeight(f.get_tensor(f"{name}.qweight"), f.get_tensor(f"{name}.scales"), mins,
                                         n, k, bits)
        return out
    out = packed_linears(Path(source.directory) / source.gguf_file, num_layers, tied_head)
    tensors: dict[str, torch.Tensor] = {}
    meta = {"linears": json.dumps(sorted(out))}
    for name, p in out.items():
        tensors[f"{name}.qweight"], tensors[f"{name}.scales"] = p.qweight, p.scales
        if p.mins is not None:
            tensors[f"{name}.mins"] = p.mins
        meta[name] = f"{p.out_features},{p.in_features},{p.bits}"
    cached.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=cached.parent, prefix=".staging-"))
    save_file(tensors, str(staging / PACKED_FILE), metadata=meta)
    publish_directory(staging, cached)
    return out
