"""HTTP errors in OpenAI's body shape: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from starlette.responses import JSONResponse

from bus.messages import ErrorInfo


class ApiError(Exception):
    """An error to answer with `status`, the OpenAI error body and any extra `headers` (e.g. Retry-After)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(_printable(message))
        self.status = status
        self.param = None if param is None else _printable(str(param))
        self.type = type
        self.headers = dict(headers or {})

    @classmethod
    def from_info(cls, info: ErrorInfo) -> "ApiError":
        """The HTTP error for an error output of the ring."""
        return cls(info.message, status=info.code, param=info.param, type=info.type)

    def body(self) -> dict[str, object]:
        """The OpenAI error body."""
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.status}}

    def response(self) -> JSONResponse:
        """The error as a JSON response."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _printable(text: str) -> str:
    """`text` with anything that is not valid Unicode (lone surrogates) escaped, so the body always encodes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def server_busy(message: str) -> ApiError:
    """A 503 the client should retry shortly (`Retry-After: 1`)."""
    return ApiError(message, 503, type="server_error", headers={"Retry-After": "1"})
