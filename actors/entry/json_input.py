"""Request bodies as JSON objects the rest of the ring can carry, or a 4xx saying why not.

Checked here, once, for every JSON route: the Content-Type (415 unless JSON; a missing one is accepted so bare
clients work), the JSON syntax, nesting depth (deep JSON would exhaust the parser's or msgpack's recursion),
strings that are not valid Unicode (a lone surrogate such as "\\ud800" cannot be UTF-8 encoded), integers
outside int64 (msgpack and torch cannot hold them) and non-finite numbers (NaN, Infinity, 1e999). The body
size limit is enforced while the body is read, by `ringserve.actors.entry.guard`.
"""

from __future__ import annotations

import json
import math
from typing import Any

from ringserve.bus.errors import ApiError, printable, quote

MAX_JSON_DEPTH = 64
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_KEY_CHARS = 40  # of each field name in an error's path
_JSON_CHARSETS = {"utf-8", "utf8"}


def check_content_type(content_type: str | None, required: bool = False) -> None:
    """ApiError 415 unless `content_type` is JSON (`application/json`, `application/*+json`, optionally with
    `charset=utf-8`) or, unless `required`, missing."""
    if content_type is None or not content_type.strip():
        if required:
            raise ApiError("send Content-Type: application/json (this route changes the server's state)", 415)
        return
    media, *params = (part.strip() for part in content_type.split(";"))
    media = media.lower()
    is_json = media == "application/json" or (media.startswith("application/") and media.endswith("+json"))
    charset_ok = True
    for param in params:
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset":
            charset_ok = value.strip().strip('"').lower() in _JSON_CHARSETS
    if not (is_json and charset_ok):
        raise ApiError(f"unsupported Content-Type {quote(content_type)}: send application/json (UTF-8)", 415,
                       type="invalid_request_error")


def parse_json_object(body: bytes) -> dict[str, Any]:
    """`body` as a JSON object whose every value the ring can carry; ApiError 400 naming the first bad field."""
    try:
        data = json.loads(body)
    except RecursionError as exc:
        raise ApiError(f"the request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)") from exc
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError, too many digits, bad UTF-8
        raise ApiError(f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ApiError("the request body must be a JSON object")
    check_carriable(data)
    return data


def _key(key: str) -> str:
    """A field name as a path shows it: escaped where it is not valid Unicode, and short."""
    return printable(key if len(key) <= MAX_KEY_CHARS else f"{key[:MAX_KEY_CHARS]}…")


def _where(path: tuple[Any, ...], most: int = 8) -> str:
    out = ""
    for key in path[:most]:
        out += f"[{key}]" if isinstance(key, int) else (f".{_key(key)}" if out else _key(key))
    return (out + ("..." if len(path) > most else "")) or "the body"


def _bad(path: tuple[Any, ...], problem: str) -> ApiError:
    param = printable(path[0]) if path and isinstance(path[0], str) else None
    return ApiError(f"{_where(path)}: {problem}", param=param)


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def check_carriable(data: Any) -> None:
    """ApiError 400 for the first value in `data` (decoded JSON) the ring cannot carry or compute with.

    Iterative, so a value just under the parser's recursion limit cannot exhaust the stack here.
    """
    stack: list[tuple[Any, tuple[Any, ...], int]] = [(data, (), 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            if not _encodable(value):
                raise _bad(path, "the string is not valid Unicode (a lone surrogate such as \\ud800?)")
        elif isinstance(value, bool) or value is None:
            continue
        elif isinstance(value, int):
            if not INT64_MIN <= value <= INT64_MAX:
                raise _bad(path, f"the integer {quote(value)} does not fit in 64 bits")
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise _bad(path, f"{value} is not a finite number")
        elif isinstance(value, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                raise _bad(path, f"nested too deeply (at most {MAX_JSON_DEPTH} levels)")
            if isinstance(value, dict):
                for key, item in value.items():
                    if not _encodable(key):
                        raise _bad(path + (key,), "the field name is not valid Unicode")
                    stack.append((item, path + (key,), depth + 1))
            else:
                stack.extend((item, path + (i,), depth + 1) for i, item in enumerate(value))
