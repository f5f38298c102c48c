"""OpenAI-style errors: one exception type the routes raise and the JSON body it becomes."""
from __future__ import annotations

from typing import Any

RETRY_AFTER_S = 1


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def overloaded(message: str = "The server is overloaded (its request queue is full); "
               "retry later.") -> APIError:
    return APIError(503, message, type="server_error", code="overloaded",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def from_engine_error(status: int, message: str) -> APIError:
    """Map a RequestError from the engine (400 never fits, 503 full or draining, ...)."""
    if status == 503:
        return overloaded(message)
    if 400 <= status < 500:
        return APIError(status, message)
    return APIError(status, message, type="server_error")
