"""HTTP errors in OpenAI's body shape: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from starlette.responses import JSONResponse

from bus.messages import ErrorInfo


class ApiError(Exception):
    """An error to answer with `status` and the OpenAI error body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.type = type

    @classmethod
    def from_info(cls, info: ErrorInfo) -> "ApiError":
        return cls(info.message, status=info.code, param=info.param, type=info.type)

    def body(self) -> dict[str, object]:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)
