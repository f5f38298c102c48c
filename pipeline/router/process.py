"""The router process: `python -m pagedserve.pipeline.router.process [flags]`, or
`pagedserve serve` with router flags (`config.wants_router`). Owns the HTTP server, the
upstream HTTP client and the engine groups it starts; SIGINT/SIGTERM stop the server, then
every group (each drains and cleans up after itself)."""
from __future__ import annotations

import asyncio
import logging
import signal
import sys
from contextlib import asynccontextmanager

import httpx
import uvicorn

from pagedserve.lifecycle import setup_logging
from pagedserve.pipeline.graceful_server import GracefulServer
from pagedserve.pipeline.ingress.limits import uvicorn_settings
from pagedserve.pipeline.router.app import build_router_app
from pagedserve.pipeline.router.config import RouterConfig, config_from_argv
from pagedserve.pipeline.router.core import RouterCore, RoutingPolicy
from pagedserve.pipeline.router.lora import RouterAdapters
from pagedserve.pipeline.router.metrics import RouterMetrics
from pagedserve.pipeline.router.model_slots import ModelSlots
from pagedserve.pipeline.router.models import ModelManager
from pagedserve.pipeline.router.pool import ReplicaPool
from pagedserve.pipeline.router.ratelimit import RateLimiter
from pagedserve.pipeline.router.service import ProxySettings, RouterService

log = logging.getLogger("pagedserve.router")


async def _start(cfg: RouterConfig, pool: ReplicaPool, models: ModelManager) -> None:
    """Remote engines joined, preloaded models loaded (all of them without
    --max-loaded-models and --preload)."""
    for url in cfg.engine_urls:
        replica = await pool.add_remote(url)
        log.info("engine %s serves %s", url, replica.model)
        if models.slots.state(replica.model).value != "loaded":
            models.mark_loaded(replica.model)
    preload = cfg.preload or ([] if cfg.max_loaded_models is not None else list(cfg.models))
    for model in preload:
        await models.acquire(model)
        await models.release(model)


def build(cfg: RouterConfig):
    """The app and its parts (a lifespan starts and stops them with the server)."""
    core = RouterCore(RoutingPolicy(load_factor=cfg.load_factor, load_floor=cfg.load_floor,
                                    affinity=cfg.routing == "affinity"))
    metrics = RouterMetrics()
    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=None,
                                                 max_keepalive_connections=256))
    pool = ReplicaPool(core, metrics, http, data_parallel_size=cfg.data_parallel_size,
                       ready_timeout=cfg.ready_timeout)
    names = list(cfg.models) or _remote_names_placeholder(cfg)
    slots = ModelSlots(names, cfg.max_loaded_models)
    models = ModelManager(cfg.models, slots, pool, metrics, load_timeout=cfg.load_timeout)
    limiter = RateLimiter({k: v for k, v in cfg.api_keys.items()
                           if v.requests_per_minute or v.tokens_per_minute},
                          burst_seconds=cfg.burst_seconds)
    settings = ProxySettings(block_size=cfg.block_size, affinity_blocks=cfg.affinity_blocks,
                             stall_timeout=cfg.stall_timeout, replica_wait=cfg.replica_wait)
    service = RouterService(core, pool, models, limiter, metrics, http, settings,
                            priority_floors={k: v.priority_floor for k, v in cfg.api_keys.items()})
    service.adapters = RouterAdapters.from_specs(cfg.models.values())
    pool.on_ready.append(lambda replica: service.adapters.replay(http, replica))

    @asynccontextmanager
    async def lifespan(_app):
        health = asyncio.ensure_future(pool.health_loop())
        try:
            await _start(cfg, pool, models)
            log.info("router ready on http://%s:%d (%d replicas)", cfg.host, cfg.port,
                     len(core.replicas))
            yield
        finally:
            health.cancel()
            await models.close()
            await pool.close()
            await http.aclose()
            log.info("router stopped")

    return build_router_app(service, list(cfg.api_keys), lifespan=lifespan), service


def _remote_names_placeholder(cfg: RouterConfig) -> list[str]:
    """Remote engines' model names are known once they answer: ask them now, synchronously."""
    names = []
    for url in cfg.engine_urls:
        try:
            info = httpx.get(f"{url.rstrip('/')}/v1/models", timeout=10).json()["data"][0]
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
            raise ValueError(f"--engine-url {url}: its /v1/models did not answer: {exc}") from None
        if info["id"] not in names:
            names.append(info["id"])
    return names


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg, die_with_parent = config_from_argv(argv)
    except ValueError as exc:
        setup_logging("router")
        log.error("bad configuration: %s", exc)
        return 2
    setup_logging("router", cfg.log_level)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per health check
    if die_with_parent:
        from pagedserve.lifecycle import die_with_parent as arm
        arm(signal.SIGTERM)
    try:
        app, _service = build(cfg)
    except ValueError as exc:
        log.error("bad configuration: %s", exc)
        return 2
    server = GracefulServer(uvicorn.Config(app, host=cfg.host, port=cfg.port, loop="uvloop",
                                           access_log=False, log_level="warning",
                                           lifespan="on", timeout_graceful_shutdown=30,
                                           **uvicorn_settings()),
                            log, "stopping the engine groups")
    log.info("router pid starting on %s:%d", cfg.host, cfg.port)
    server.run()
    return 0 if server.started else 1


if __name__ == "__main__":
    from pagedserve.lifecycle import exit_role
    exit_role(main())
