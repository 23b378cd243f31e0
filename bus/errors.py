"""The one error type of the ring: raised where a request fails, carried on the wire, answered as HTTP.

`ApiError` is both an exception and a wire struct (a dataclass the codec encodes): the tokenizer raises it for
a bad parameter, the engine returns it for a request it cannot run, an error finish carries it, the
detokenizer forwards it in `RequestOutput.error`, and the entry renders it as OpenAI's body
`{"error": {"message", "type", "param", "code"}}` with `code` as the HTTP status.
"""

from __future__ import annotations

from dataclasses import dataclass


def printable(text: str) -> str:
    """`text` with anything that is not valid Unicode (lone surrogates) escaped, so a body always encodes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


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
        self.message = printable(self.message)
        if self.param is not None:
            self.param = printable(str(self.param))

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict[str, object]:
        """OpenAI's error body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def server_error(message: str, code: int = 500) -> ApiError:
    """A failure of the server, not of the request (`type` "server_error")."""
    return ApiError(message, code, type="server_error")
