"""Talking to one replica over HTTP: a streamed request's SSE events, parsed, with the ways
it can fail told apart (refused with a status: the client's answer; broken: resume elsewhere)."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

DONE = "[DONE]"


class ReplicaRefused(Exception):
    """The replica answered with an error status before streaming."""

    def __init__(self, status: int, body: bytes, headers: dict[str, str]):
        super().__init__(f"replica answered {status}")
        self.status = status
        self.body = body
        self.headers = headers


class ReplicaBroken(Exception):
    """The replica died, stalled, or failed the request inside its stream."""


def _is_server_error(event: dict[str, Any]) -> bool:
    error = event.get("error")
    return isinstance(error, dict) and error.get("type") == "server_error"


async def stream_events(http: httpx.AsyncClient, url: str, body: dict[str, Any], *,
                        headers: dict[str, str], stall_timeout: float
                        ) -> AsyncIterator[dict[str, Any] | str]:
    """The parsed `data:` events of a streamed POST, ending with DONE. Raises ReplicaRefused
    for an error status, ReplicaBroken when the connection fails, no event arrives for
    `stall_timeout` seconds, the stream ends without [DONE], or it reports a server error."""
    timeout = httpx.Timeout(10.0, read=stall_timeout)
    try:
        async with http.stream("POST", url, json=body, headers=headers, timeout=timeout) as resp:
            if resp.status_code != 200:
                raw = await resp.aread()
                keep = {k: v for k, v in resp.headers.items() if k.lower() == "retry-after"}
                raise ReplicaRefused(resp.status_code, raw, keep)
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[len("data: "):]
                if payload == DONE:
                    yield DONE
                    return
                event = json.loads(payload)
                if _is_server_error(event):
                    raise ReplicaBroken(f"the replica failed the request: "
                                        f"{event['error'].get('message')}")
                yield event
    except httpx.TimeoutException as exc:
        raise ReplicaBroken(f"no answer for {stall_timeout:.0f} s ({type(exc).__name__})") from None
    except (httpx.TransportError, json.JSONDecodeError) as exc:
        raise ReplicaBroken(f"{type(exc).__name__}: {exc}") from None
    raise ReplicaBroken("the stream ended without [DONE]")
