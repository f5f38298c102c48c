"""The web page (`/`): chat with the served models and watch the engine live.

The page and its modules are static files shipped in the package (`webui/`, no build step, no
network); they load without the API key, but every call the page makes carries the key the
user typed. `/engine/state` is the JSON its engine panel polls each second, behind the key like
/v1/*: the scheduler's gauges and counters (the page turns counters into rates), the ingress's
aborted requests, and the group's processes. The router serves the same page and an
`/engine/state` of every replica (pipeline/router/app.py).
"""
from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.params import Depends
from starlette.responses import FileResponse, JSONResponse
from starlette.staticfiles import StaticFiles

from pagedserve.pipeline.ingress.processes import group_processes, uptime_s

WEBUI_DIR = Path(__file__).with_name("webui")
# the scheduler's stats the panel shows; the rest (grammar timings, unknown messages) stay in
# /metrics
STATE_KEYS = ("num_requests_running", "num_requests_waiting", "num_requests_swapped",
              "kv_cache_usage_perc", "kv_blocks_used", "kv_blocks_total", "cpu_blocks_used",
              "cpu_blocks_total", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions",
              "prompt_tokens", "generation_tokens", "iteration_tokens", "restarts")
# the page is ours to describe: no other origin may frame it or feed it scripts
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
                "style-src 'self'; frame-ancestors 'none'", "X-Content-Type-Options": "nosniff",
                "Cache-Control": "no-cache"}


def add_webui_routes(app: FastAPI, state: Callable[[], Awaitable[dict[str, Any]]],
                     dependencies: Sequence[Depends] = ()) -> None:
    """`/` (the page), `/webui/*` (its modules) and `/engine/state` (`state()`, behind
    `dependencies`: the API key check)."""
    app.mount("/webui", StaticFiles(directory=WEBUI_DIR), name="webui")

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(WEBUI_DIR / "index.html", headers=PAGE_HEADERS)

    async def engine_state() -> JSONResponse:
        return JSONResponse(await state(), headers={"Cache-Control": "no-store"})

    app.add_api_route("/engine/state", engine_state, methods=["GET"], include_in_schema=False,
                      dependencies=list(dependencies))


def engine_snapshot(name: str, stats: dict[str, Any], aborted: float) -> dict[str, Any]:
    """One engine group as the page shows it."""
    picked = {key: stats[key] for key in STATE_KEYS if key in stats}
    picked["requests_aborted"] = aborted
    return {"name": name, "stats": picked,
            "processes": group_processes(stats.get("restarts") or {})}


def ingress_state(ctx: Any) -> Callable[[], Awaitable[dict[str, Any]]]:
    """`/engine/state` of one engine group: its models, its stats, its processes."""
    async def state() -> dict[str, Any]:
        await ctx.refresh_stats()  # the last snapshot is kept when the scheduler is slow
        return {"time": time.time(), "models": list(ctx.served_model_names),
                "engines": [engine_snapshot(ctx.model_name, ctx.metrics.engine.snapshot,
                                            ctx.metrics.aborted_samples())],
                "replicas": []}
    return state


def this_process(name: str) -> dict[str, Any]:
    """A row for the process answering (the router lists itself so)."""
    pid = os.getpid()
    return {"name": name, "role": name, "pid": pid, "uptime_s": uptime_s(pid), "restarts": 0}
