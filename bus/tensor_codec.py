"""Named numpy arrays <-> bytes, for processed image tensors in the object store (bus/image_store.py).

The encoding is a msgpack map `{name: {"dtype": <numpy dtype string>, "shape": [...], "data": <bytes, C order>}}`
with the names sorted, so the same tensors always encode to the same bytes and their sha256 (`tensors_hash`)
names the image. Nothing is unpickled: only plain numeric dtypes (bool, ints, floats) are read back, and the data
must be exactly as long as dtype and shape say.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgpack
import numpy as np

from ringserve.bus.codec import DecodeError

ALLOWED_KINDS = "biuf"  # numpy dtype kinds: bool, signed and unsigned ints, floats (no objects, no strings)
MAX_DIMS = 8


def encode_tensors(tensors: dict[str, Any]) -> bytes:
    """`tensors` (name -> array-like) as bytes; the same tensors always give the same bytes."""
    body = {}
    for name in sorted(tensors):
        array = np.ascontiguousarray(np.asarray(tensors[name]))
        if array.dtype.kind not in ALLOWED_KINDS:
            raise ValueError(f"tensor {name!r} has dtype {array.dtype}, not a plain number type")
        body[name] = {"dtype": array.dtype.str, "shape": list(array.shape), "data": array.tobytes()}
    return msgpack.packb(body, use_bin_type=True)


def decode_tensors(data: bytes) -> dict[str, np.ndarray]:
    """The arrays `encode_tensors` wrote (read-only views of `data`); DecodeError for anything else."""
    try:
        body = msgpack.unpackb(data, raw=False)
    except Exception as exc:  # msgpack raises several unrelated exception types
        raise DecodeError(f"tensors: not msgpack: {exc}") from exc
    if not isinstance(body, dict):
        raise DecodeError("tensors: expected a map of name -> tensor")
    out: dict[str, np.ndarray] = {}
    for name, entry in body.items():
        if not isinstance(name, str) or not isinstance(entry, dict):
            raise DecodeError("tensors: expected a map of name -> {dtype, shape, data}")
        dtype_str, shape, raw = entry.get("dtype"), entry.get("shape"), entry.get("data")
        try:
            dtype = np.dtype(dtype_str) if isinstance(dtype_str, str) else None
        except TypeError:
            dtype = None
        if dtype is None or dtype.kind not in ALLOWED_KINDS:
            raise DecodeError(f"tensors[{name!r}]: dtype {dtype_str!r} is not a plain number type")
        if (not isinstance(shape, list) or len(shape) > MAX_DIMS
                or not all(type(d) is int and d >= 0 for d in shape)):
            raise DecodeError(f"tensors[{name!r}]: shape {shape!r} is not a list of sizes")
        if not isinstance(raw, bytes) or len(raw) != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
            raise DecodeError(f"tensors[{name!r}]: the data does not match dtype {dtype} and shape {shape}")
        out[name] = np.frombuffer(raw, dtype=dtype).reshape(shape)
    return out


def tensors_hash(encoded: bytes) -> str:
    """The sha256 hex digest of encoded tensors: the image's hash (`ImageRef.hash`)."""
    return hashlib.sha256(encoded).hexdigest()
