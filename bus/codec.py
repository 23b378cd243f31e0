"""msgpack encoding of typed wire messages, with a typed decoder.

A message is a dataclass; on the wire it is the msgpack map `{"type": <class name>, "body": {field: value}}`.
`decode(data, Expected)` checks the type tag and every field's type, recursing into nested messages, so a
malformed or hostile payload raises `DecodeError` instead of reaching actor code. Nothing is ever unpickled.
Unknown fields are ignored (newer senders may add fields); missing fields take their defaults.

JSON is accepted too, so tools without msgpack (the `nats` CLI) can send messages: a payload whose first byte
is `{`, `[` or whitespace (never the first byte of a msgpack map) is read as JSON, either the same envelope
`{"type": ..., "body": {...}}` or the bare body `{field: value}`. `is_json` tells a receiver which encoding a
request used, so it can answer in the same one (`encode_json`).
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from functools import lru_cache
from typing import Any, TypeVar

import msgpack

T = TypeVar("T")


class DecodeError(ValueError):
    """A payload that is not a valid encoding of the expected message type."""


def to_wire(msg: Any) -> Any:
    """A message (or value) as plain msgpack-able data."""
    if dataclasses.is_dataclass(msg) and not isinstance(msg, type):
        return {f.name: to_wire(getattr(msg, f.name)) for f in dataclasses.fields(msg)}
    if isinstance(msg, (list, tuple)):
        return [to_wire(v) for v in msg]
    if isinstance(msg, dict):
        return {k: to_wire(v) for k, v in msg.items()}
    return msg


def encode(msg: Any) -> bytes:
    """Encode a message dataclass as msgpack bytes."""
    return msgpack.packb({"type": type(msg).__name__, "body": to_wire(msg)}, use_bin_type=True)


def encode_json(msg: Any) -> bytes:
    """Encode a message dataclass as the JSON envelope `{"type", "body"}` (for requesters that sent JSON)."""
    return json.dumps({"type": type(msg).__name__, "body": to_wire(msg)}, ensure_ascii=False).encode()


def is_json(data: bytes) -> bool:
    """Whether a payload is JSON text: it starts with `{`, `[` or whitespace, which no msgpack map does."""
    return data[:1] in (b"{", b"[", b" ", b"\t", b"\r", b"\n")


def _json_envelope(data: bytes, expected: type) -> Any:
    """A JSON payload as an envelope: the envelope itself, or a bare body wrapped as one of `expected`."""
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise DecodeError(f"not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise DecodeError(f"a JSON message must be an object, got {type(value).__name__}")
    if "type" in value and "body" in value:
        return value
    return {"type": expected.__name__, "body": value}


def decode(data: bytes, expected: type[T]) -> T:
    """Decode bytes produced by `encode` (or JSON, see the module doc) into an `expected` instance, validating
    every field."""
    if is_json(data):
        envelope = _json_envelope(data, expected)
    else:
        try:
            envelope = msgpack.unpackb(data, raw=False, strict_map_key=False)  # key types are checked by from_wire
        except Exception as exc:  # msgpack raises several unrelated exception types
            raise DecodeError(f"not msgpack: {exc}") from exc
    if not isinstance(envelope, dict) or envelope.get("type") != expected.__name__:
        got = envelope.get("type") if isinstance(envelope, dict) else type(envelope).__name__
        raise DecodeError(f"expected message {expected.__name__}, got {got!r}")
    return from_wire(expected, envelope.get("body"), expected.__name__)


def peek_field(data: bytes, name: str) -> Any:
    """Field `name` of a message's body, read without decoding the rest (None if absent or not msgpack): how a
    receiver names the request a malformed message was meant to be, so it can answer it with an error."""
    try:
        envelope = (_json_envelope(data, object) if is_json(data)
                    else msgpack.unpackb(data, raw=False, strict_map_key=False))
    except Exception:
        return None
    body = envelope.get("body") if isinstance(envelope, dict) else None
    return body.get(name) if isinstance(body, dict) else None


@lru_cache(maxsize=None)
def _field_types(cls: type) -> tuple[tuple[str, Any, bool], ...]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        out.append((f.name, hints[f.name], has_default))
    return tuple(out)


def from_wire(tp: Any, value: Any, where: str) -> Any:
    """Convert plain decoded data `value` to type `tp`, raising DecodeError naming `where` on mismatch."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(tp):
            try:
                return from_wire(option, value, where)
            except DecodeError:
                continue
        raise DecodeError(f"{where}: {value!r} does not match {tp}")
    if tp is type(None):
        if value is None:
            return None
        raise DecodeError(f"{where}: expected null")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise DecodeError(f"{where}: expected a map for {tp.__name__}")
        kwargs = {}
        for name, ftype, has_default in _field_types(tp):
            if name in value:
                kwargs[name] = from_wire(ftype, value[name], f"{where}.{name}")
            elif not has_default:
                raise DecodeError(f"{where}: missing field {name!r}")
        return tp(**kwargs)
    if origin is list:
        if not isinstance(value, list):
            raise DecodeError(f"{where}: expected a list")
        (item,) = typing.get_args(tp)
        if item is int and all(type(v) is int for v in value):
            return value  # fast path for token-id lists
        return [from_wire(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise DecodeError(f"{where}: expected a map")
        key_t, val_t = typing.get_args(tp)
        return {from_wire(key_t, k, where): from_wire(val_t, v, f"{where}[{k!r}]") for k, v in value.items()}
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise DecodeError(f"{where}: expected a number, got {type(value).__name__}")
    if tp is int:
        if type(value) is int:
            return value
        raise DecodeError(f"{where}: expected an integer, got {type(value).__name__}")
    if tp in (str, bool, bytes):
        if type(value) is tp:
            return value
        raise DecodeError(f"{where}: expected {tp.__name__}, got {type(value).__name__}")
    raise DecodeError(f"{where}: unsupported wire type {tp}")
