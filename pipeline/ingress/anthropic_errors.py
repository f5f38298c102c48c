"""Errors of /v1/messages in Anthropic's shape: `{"type": "error", "error": {"type",
"message"}}`, the error's type told by its HTTP status as Anthropic's API tells it. The router
answers its own refusals on that route with the same bodies."""
from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from pagedserve.pipeline.ingress.errors import APIError

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
          503: "overloaded_error", 529: "overloaded_error"}


def error_type(status: int) -> str:
    return _TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def anthropic_error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(anthropic_error_body(exc.status, exc.message), status_code=exc.status,
                        headers=exc.headers)
