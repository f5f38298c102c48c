"""LoRA adapters through the router: a request naming an adapter goes to a replica of the model
the adapter adapts, chosen by the adapter's name on that model's hash ring (so one adapter's
requests gather where it is already resident, spilling to the least-loaded replica past the
load bound as any request does); /v1/load_lora_adapter and /v1/unload_lora_adapter go to every
replica of the model; /v1/models lists the adapters with their `parent`.

The router knows an adapter from the engines' --lora-modules (its engine arguments) and from
the loads that pass through it; a replica the router (re)starts gets the latter loaded again
before it takes requests.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
from typing import Any

import httpx

from pagedserve.pipeline.lora_config import parse_lora_module

log = logging.getLogger("pagedserve.router")


def adapter_key(name: str) -> bytes:
    """The affinity key of an adapter's requests (in place of their prompt's prefix)."""
    return hashlib.sha256(b"lora\x00" + name.encode()).digest()[:16]


class RouterAdapters:
    """Adapter name -> the served model it adapts (pure: no sockets)."""

    def __init__(self) -> None:
        self.base_of: dict[str, str] = {}
        self.loaded: dict[str, dict[str, Any]] = {}   # loaded through the router: its body

    def add(self, name: str, base: str, body: dict[str, Any]) -> None:
        self.base_of[name] = base
        self.loaded[name] = body

    def remove(self, name: str) -> None:
        self.base_of.pop(name, None)
        self.loaded.pop(name, None)

    async def replay(self, http: httpx.AsyncClient, replica) -> None:
        """Load into a replica that (re)started the adapters loaded through the router for
        its model (the pool calls this before the replica takes requests)."""
        for name, body in sorted(self.loaded.items()):
            if self.base_of.get(name) != replica.model:
                continue
            status, _ = await broadcast(http, [replica], "/v1/load_lora_adapter", body)
            if status != 200:
                log.warning("LoRA adapter %r not loaded again into %s (status %d)", name,
                            replica.replica_id, status)

    @classmethod
    def from_specs(cls, specs) -> "RouterAdapters":
        """The adapters each model's engines load at start (--lora-modules in its args)."""
        adapters = cls()
        for spec in specs:
            args = list(spec.engine_args)
            if "--lora-modules" not in args:
                continue
            for entry in args[args.index("--lora-modules") + 1:]:
                if entry.startswith("--"):
                    break
                adapters.base_of[parse_lora_module(entry)[0]] = spec.model
        return adapters

    def base(self, name: Any) -> str | None:
        return self.base_of.get(name) if isinstance(name, str) else None

    def cards(self, created: int) -> list[dict[str, Any]]:
        return [{"id": name, "object": "model", "created": created, "owned_by": "pagedserve",
                 "root": name, "parent": base} for name, base in sorted(self.base_of.items())]


async def broadcast(http: httpx.AsyncClient, replicas, path: str, body: dict[str, Any]
                    ) -> tuple[int, bytes]:
    """POST `body` to `path` of every replica: (200, the first answer) when all succeed, else
    the first failure's status and body."""
    if not replicas:
        return 503, b'{"error": {"message": "no healthy replica serves that model", ' \
                    b'"type": "server_error", "code": "no_replica"}}'

    async def one(replica) -> tuple[int, bytes]:
        try:
            resp = await http.post(replica.url + path, json=body, headers=replica.headers,
                                   timeout=60)
            return resp.status_code, resp.content
        except httpx.HTTPError as exc:
            return 502, (f'{{"error": {{"message": "replica {replica.replica_id} failed: '
                         f'{type(exc).__name__}", "type": "server_error"}}}}').encode()
    answers = await asyncio.gather(*(one(r) for r in replicas))
    failed = [a for a in answers if a[0] != 200]
    return failed[0] if failed else answers[0]
