"""A GGUF file's scalar and string metadata, read from its header alone.

`gguf.GGUFReader` maps every tensor and decodes every array (a vocabulary of 256k tokens is seconds of Python
on a small CPU); the launcher needs a handful of fields (the architecture, the expert count, the chat
template), so this reads the key-value section and skips arrays by their size, without decoding them.
"""

from __future__ import annotations

import struct
from typing import Any, BinaryIO

MAGIC = b"GGUF"
STRING, ARRAY = 8, 9
# value type -> struct format of one scalar (little-endian, as every GGUF llama.cpp writes today)
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


class GGUFHeaderError(ValueError):
    """A file that is not a GGUF this reader understands (its message says what was found)."""


def _unpack(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise GGUFHeaderError("the file ends inside its metadata")
    return struct.unpack(fmt, data)[0]


def _string(f: BinaryIO) -> str:
    length = _unpack(f, "<Q")
    data = f.read(length)
    if len(data) != length:
        raise GGUFHeaderError("the file ends inside its metadata")
    return data.decode("utf-8", errors="replace")


def _skip_array(f: BinaryIO) -> None:
    item_type, count = _unpack(f, "<I"), _unpack(f, "<Q")
    if item_type in SCALARS:
        f.seek(struct.calcsize(SCALARS[item_type]) * count, 1)
    elif item_type == STRING:
        for _ in range(count):
            f.seek(_unpack(f, "<Q"), 1)
    elif item_type == ARRAY:
        for _ in range(count):
            _skip_array(f)
    else:
        raise GGUFHeaderError(f"unknown GGUF value type {item_type}")


def read_gguf_metadata(path: str) -> dict[str, Any]:
    """The metadata of the GGUF file at `path` whose values are scalars or strings (arrays are left out).

    Raises OSError when the file cannot be read and GGUFHeaderError when it is not a GGUF (v2 or v3, little-endian).
    """
    with open(path, "rb") as f:
        if f.read(4) != MAGIC:
            raise GGUFHeaderError("no GGUF magic at the start")
        version = _unpack(f, "<I")
        if version not in (2, 3):
            raise GGUFHeaderError(f"GGUF version {version} (a big-endian file?) is not read")
        _unpack(f, "<Q")  # the tensor count
        fields: dict[str, Any] = {}
        for _ in range(_unpack(f, "<Q")):
            key, value_type = _string(f), _unpack(f, "<I")
            if value_type in SCALARS:
                fields[key] = _unpack(f, SCALARS[value_type])
            elif value_type == STRING:
                fields[key] = _string(f)
            elif value_type == ARRAY:
                _skip_array(f)
            else:
                raise GGUFHeaderError(f"unknown GGUF value type {value_type} for {key!r}")
    return fields
