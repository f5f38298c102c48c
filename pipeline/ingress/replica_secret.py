"""A replica behind the router takes requests only from that router.

The router starts each local engine group on 127.0.0.1 with a secret of its own
(`--replica-secret-file`, a 0600 file) and sends it in a header with every request; any other
local user could otherwise reach the replica's port directly, without the router's API keys
and rate limits, and read its /metrics. /health stays open: liveness needs no secret.
"""
from __future__ import annotations

import secrets

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedserve.pipeline.config import REPLICA_SECRET_HEADER
from pagedserve.pipeline.ingress.errors import error_body

__all__ = ["REPLICA_SECRET_HEADER", "ReplicaSecretCheck"]
OPEN_PATHS = frozenset({"/health"})


class ReplicaSecretCheck:
    """ASGI middleware: 401 for every HTTP request but OPEN_PATHS that lacks the secret."""

    def __init__(self, app: ASGIApp, secret: str):
        self.app = app
        self.secret = secret.encode()
        self.header = REPLICA_SECRET_HEADER.lower().encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._carries_secret(scope):
            await self.app(scope, receive, send)
            return
        refusal = JSONResponse(error_body(
            f"this engine serves only the router that started it (the {REPLICA_SECRET_HEADER} "
            "header is missing or wrong)", code="invalid_replica_secret"), status_code=401)
        await refusal(scope, receive, send)

    def _carries_secret(self, scope: Scope) -> bool:
        given = [value for name, value in scope["headers"] if name == self.header]
        return len(given) == 1 and secrets.compare_digest(given[0], self.secret)
