"""The web page on the router: the ingress's page and modules (pipeline/ingress/webui.py), and
an `/engine/state` that gathers every replica's own (each asked with the headers the router
sends it, its secret for a local group) beside the router's view of the replicas."""
from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from pagedserve.pipeline.ingress.webui import this_process
from pagedserve.pipeline.router.core import Replica

REPLICA_STATE_TIMEOUT_S = 2.0


async def replica_state(http: httpx.AsyncClient, replica: Replica) -> dict[str, Any]:
    """The replica's engine as its /engine/state shows it, or a row that says why not."""
    try:
        response = await http.get(f"{replica.url}/engine/state", headers=replica.headers,
                                  timeout=REPLICA_STATE_TIMEOUT_S)
        if response.status_code == 200:
            engine = response.json()["engines"][0]
            return {**engine, "name": replica.replica_id}
        error = f"its /engine/state answered {response.status_code}"
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
        error = f"unreachable: {type(exc).__name__}"
    return {"name": replica.replica_id, "stats": {}, "processes": [], "error": error}


def replica_row(service: Any, replica: Replica) -> dict[str, Any]:
    group = service.pool.groups.get(replica.replica_id)
    return {"id": replica.replica_id, "model": replica.model, "healthy": replica.healthy,
            "outstanding_requests": replica.outstanding_requests,
            "outstanding_tokens": replica.outstanding_tokens,
            # a local group's restarts; a remote engine's are its own business
            "restarts": max(0, group.starts - 1) if group is not None else 0}


def router_state(service: Any):
    """`/engine/state` for the router: the router's process, each replica's engine, and the
    replicas' states as the router sees them."""
    async def state() -> dict[str, Any]:
        replicas = list(service.core.replicas.values())
        engines = await asyncio.gather(*(replica_state(service.pool.http, r) for r in replicas))
        router = {"name": "router", "stats": {}, "processes": [this_process("router")]}
        return {"time": time.time(), "models": list(service.models.slots.models),
                "engines": [router, *engines],
                "replicas": [replica_row(service, r) for r in replicas]}
    return state
