"""The one error type of the ring: raised where a request fails, carried on the wire, answered as HTTP.

`ApiError` is both an exception and a wire struct (a dataclass the codec encodes): the tokenizer raises it for
a bad parameter, the engine returns it for a request it cannot run, an error finish carries it, the
detokenizer forwards it in `RequestOutput.error`, and the entry renders it as OpenAI's body
`{"error": {"message", "type", "param", "code"}}` with `code` as the HTTP status.
"""

from __future__ import annotations

import itertools
import reprlib
from dataclasses import dataclass
from typing import Any

from ringserve.observability.logging import bounded

MAX_QUOTED_CHARS = 200  # of a client's value quoted in a message
MAX_MESSAGE_CHARS = 1000  # of any message: a hostile value quoted without `quote` cannot grow a body past it
MAX_PARAM_CHARS = 200  # of `param`, a field's name (which a client may have made up)


class _Brief(reprlib.Repr):
    """reprlib's short repr, with an object's keys in the client's order (reprlib sorts them)."""

    def repr_dict(self, x: dict[Any, Any], level: int) -> str:
        if not x:
            return "{}"
        if level <= 0:
            return "{...}"
        pieces = [f"{self.repr1(k, level - 1)}: {self.repr1(v, level - 1)}"
                  for k, v in itertools.islice(x.items(), self.maxdict)]
        return "{" + ", ".join(pieces + (["..."] if len(x) > self.maxdict else [])) + "}"


_REPR = _Brief()  # containers shown by their first items, nested ones by their type
_REPR.maxlevel, _REPR.maxdict, _REPR.maxlist, _REPR.maxtuple, _REPR.maxset = 3, 8, 8, 8, 8
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = MAX_QUOTED_CHARS


def printable(text: str) -> str:
    """`text` with anything that is not valid Unicode (lone surrogates) escaped, so a body always encodes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def clip(text: str, limit: int = MAX_QUOTED_CHARS) -> str:
    """A client's text as a message shows it unquoted (as OpenAI names an unknown field): at most `limit`
    characters of it."""
    return bounded(text, limit)


def quote(value: Any, limit: int = MAX_QUOTED_CHARS) -> str:
    """A client's `value` as an error message quotes it: its Python repr (a string's start, a container's first
    items), at most about `limit` characters of it."""
    if isinstance(value, str):
        return repr(value) if len(value) <= limit else f"{value[:limit]!r}…[+{len(value) - limit} chars]"
    return bounded(_REPR.repr(value), limit)


@dataclass(unsafe_hash=True)
class ApiError(Exception):
    """An error in OpenAI's shape; `code` is the HTTP status, `param` the offending field (if one is).

    `retry_after` (seconds), when set, tells the client to retry: the entry sends it as `Retry-After`.
    """

    message: str
    code: int = 400
    param: str | None = None
    type: str = "invalid_request_error"
    retry_after: int | None = None

    def __post_init__(self) -> None:
        self.message = printable(bounded(self.message, MAX_MESSAGE_CHARS))
        if self.param is not None:
            self.param = printable(bounded(str(self.param), MAX_PARAM_CHARS))

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict[str, object]:
        """OpenAI's error body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def server_error(message: str, code: int = 500) -> ApiError:
    """A failure of the server, not of the request (`type` "server_error")."""
    return ApiError(message, code, type="server_error")
