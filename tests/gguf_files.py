"""GGUF files the tests derive from the packaged ones: `truncated_gguf` keeps a model's first layers (every
tensor's blocks copied as they are, the metadata with the smaller block count), for tests that need the real
file's shapes and block types but not its depth (compiling a graph costs time per layer)."""

from __future__ import annotations

import re
from pathlib import Path

from gguf import GGUFReader, GGUFValueType, GGUFWriter


def truncated_gguf(source: Path, path: Path, layers: int) -> Path:
    """Write `source`'s first `layers` decoder blocks (and every tensor outside the blocks) to `path`."""
    reader = GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(path, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":  # written by the writer itself
            continue
        vtype = field.types[0]
        value = layers if key == f"{arch}.block_count" else field.contents()
        writer.add_key_value(key, value, vtype, field.types[-1] if vtype == GGUFValueType.ARRAY else None)
    for tensor in reader.tensors:
        block = re.match(r"blk\.(\d+)\.", tensor.name)
        if block is None or int(block.group(1)) < layers:
            writer.add_tensor(tensor.name, tensor.data, raw_shape=tensor.data.shape, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
