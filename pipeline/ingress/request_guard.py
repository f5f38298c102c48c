"""The ingress's part in quarantining a request that ends it.

Every generation request gets a key: a digest of its path and body, computed once in time
linear in the body. While the ingress runs a request's synchronous work (parsing, validation,
the chat template, tokenizing, shaping each delta) its breadcrumb names that key
(pagedserve/breadcrumb.py); an await never happens inside a marked section, so a mark always
names the request whose code runs. If the ingress hangs or crashes there, the launcher reads
the mark and adds the key to the quarantine list the next ingress reads at its start: the same
request sent again (a client's retry) is refused with a clear 400 instead of ending the ingress
again, with every request in flight on it, until the group gives up.
"""
from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterable

from pagedserve.breadcrumb import NoBreadcrumb
from pagedserve.pipeline.ingress.errors import APIError


class RequestGuard:
    def __init__(self, breadcrumb=None, quarantined: Iterable[str] = (), faults=None) -> None:
        self.breadcrumb = breadcrumb or NoBreadcrumb()
        self.quarantined = frozenset(quarantined)
        self.faults = faults if faults is not None and faults.wants_tokens else None

    @staticmethod
    def key(path: str, body: bytes) -> str:
        return hashlib.sha256(path.encode() + b"\0" + body).hexdigest()[:32]

    def admit(self, path: str, body: bytes) -> str:
        """The request's key; a quarantined request is refused here (400)."""
        key = self.key(path, body)
        if key in self.quarantined:
            raise APIError(400, f"this request (key {key}) ended the server's HTTP process when "
                                "it was sent before, so it is refused: change the request, "
                                "or report it as a bug", code="request_quarantined")
        return key

    def section(self, key: str) -> contextlib.AbstractContextManager:
        """Mark `key` while a block of the request's synchronous work runs (no await in it)."""
        return self.breadcrumb.mark(key)

    def poison(self, token_ids) -> None:
        """PAGEDSERVE_FAULT's token=<id> trigger, for tests: inside a section."""
        if self.faults is not None:
            self.faults.on_tokens(token_ids)
