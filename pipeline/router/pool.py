"""The replicas' lifecycle: local engine groups started, health-checked, restarted when they
die and stopped; remote engines (given by URL) health-checked. It owns the `LocalGroup`s and
tells `RouterCore` which replicas exist and which are healthy."""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable

import httpx

from pagedserve.pipeline.router.core import Replica, RouterCore
from pagedserve.pipeline.router.groups import GroupSpec, LocalGroup
from pagedserve.pipeline.router.metrics import RouterMetrics

log = logging.getLogger("pagedserve.router")


class ReplicaPool:
    def __init__(self, core: RouterCore, metrics: RouterMetrics, http: httpx.AsyncClient, *,
                 data_parallel_size: int = 1, ready_timeout: float = 600.0,
                 health_interval: float = 1.0, failures_to_down: int = 3,
                 max_restarts: int = 3, restart_window: float = 300.0,
                 clock: Callable[[], float] = time.monotonic):
        if data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be at least 1, got {data_parallel_size}")
        self.core = core
        self.metrics = metrics
        self.http = http
        self.data_parallel_size = data_parallel_size
        self.ready_timeout = ready_timeout
        self.health_interval = health_interval
        self.failures_to_down = failures_to_down
        self.max_restarts = max_restarts      # restarts of one group within restart_window,
        self.restart_window = restart_window  # beyond which it stays down (a crash loop)
        self.clock = clock
        self._restart_times: dict[str, collections.deque] = collections.defaultdict(
            collections.deque)
        self.groups: dict[str, LocalGroup] = {}
        self._failures: dict[str, int] = {}
        self._restarting: set[str] = set()
        self._tasks: set[asyncio.Task] = set()
        # awaited with a replica that is ready, before it takes requests (LoRA: lora.py)
        self.on_ready: list[Callable[[Replica], Awaitable[None]]] = []

    # -- local groups ------------------------------------------------------------------------
    async def start_model(self, spec: GroupSpec) -> None:
        """Start the model's groups and wait until every one answers (RuntimeError naming the
        group that failed; the others are stopped again)."""
        groups = [LocalGroup(spec, i) for i in range(self.data_parallel_size)]
        for group in groups:
            group.start()
            self.groups[group.name] = group
            self.core.add(Replica(group.name, spec.model, group.url, headers=group.headers))
        try:
            await asyncio.gather(*(self._until_ready(g) for g in groups))
        except BaseException:
            await self.stop_model(spec.model)
            raise

    async def _until_ready(self, group: LocalGroup) -> None:
        info = await group.wait_ready(self.http, self.ready_timeout)
        replica = self.core.replicas[group.name]
        replica.url, replica.headers = group.url, group.headers
        replica.max_model_len = int(info.get("max_model_len") or 0)
        replica.upstream_model = info.get("id", group.spec.model)
        replica.capabilities = listed_capabilities(info)
        self._failures[group.name] = 0
        for hook in self.on_ready:
            await hook(replica)
        self.core.set_healthy(group.name, True)
        log.info("engine group %s ready at %s (%.1f s after its start)", group.name, group.url,
                 time.monotonic() - group.started_at)

    async def stop_model(self, model: str) -> None:
        names = [n for n, g in self.groups.items() if g.spec.model == model]
        for name in names:
            self.core.set_healthy(name, False)
        await asyncio.gather(*(self.groups[n].stop() for n in names))
        for name in names:
            self.groups.pop(name, None)
            self.core.remove(name)
            self._restarting.discard(name)

    def may_restart(self, name: str) -> bool:
        """Counts a restart of group `name`; False (and it stays down) past max_restarts
        within restart_window seconds."""
        now, times = self.clock(), self._restart_times[name]
        while times and times[0] < now - self.restart_window:
            times.popleft()
        if len(times) >= self.max_restarts:
            if len(times) == self.max_restarts:
                log.error("engine group %s died %d times within %.0f s: not restarted again "
                          "(a crash loop; its log is above)", name, len(times),
                          self.restart_window)
                times.append(now)  # logged once per window
            return False
        times.append(now)
        return True

    async def _restart(self, group: LocalGroup) -> None:
        log.warning("engine group %s pid=%s died (code %s); restarting it", group.name,
                    group.pid, group.proc.returncode if group.proc else None)
        self.metrics.replica_restarts.labels(group.spec.model).inc()
        try:
            group.reap()
            group.start()
            replica = self.core.replicas[group.name]
            replica.url, replica.headers = group.url, group.headers
            await self._until_ready(group)
        except Exception as exc:  # the next health round tries again
            log.error("restarting engine group %s failed: %s", group.name, exc)
        finally:
            self._restarting.discard(group.name)

    # -- remote engines ----------------------------------------------------------------------
    async def add_remote(self, url: str) -> Replica:
        """A running engine by its base URL; its model is what its /v1/models lists first."""
        url = url.rstrip("/")
        try:
            info = (await self.http.get(f"{url}/v1/models", timeout=10)).json()["data"][0]
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
            raise RuntimeError(f"engine {url} did not list its model at /v1/models: {exc}") from None
        replica = Replica(url, info["id"], url, max_model_len=int(info.get("max_model_len") or 0),
                          upstream_model=info["id"], capabilities=listed_capabilities(info))
        self.core.add(replica)
        await self._check(replica)
        return replica

    # -- health ------------------------------------------------------------------------------
    async def _check(self, replica: Replica) -> None:
        group = self.groups.get(replica.replica_id)
        if group is not None and not group.alive:
            self.core.set_healthy(replica.replica_id, False)
            if replica.replica_id not in self._restarting and self.may_restart(group.name):
                self._restarting.add(replica.replica_id)
                self._spawn(self._restart(group))
            return
        if replica.replica_id in self._restarting:
            return
        try:
            # generous: a busy engine answers late, and a stream that stalls is caught apart
            ok = (await self.http.get(f"{replica.url}/health", timeout=5)).status_code == 200
        except httpx.HTTPError:
            ok = False
        misses = 0 if ok else self._failures.get(replica.replica_id, 0) + 1
        self._failures[replica.replica_id] = misses
        if ok and self.core.set_healthy(replica.replica_id, True):
            log.info("replica %s is healthy again", replica.replica_id)
        elif misses >= self.failures_to_down and self.core.set_healthy(replica.replica_id, False):
            log.warning("replica %s failed %d health checks: not routed to", replica.replica_id,
                        misses)

    def suspect(self, replica_id: str) -> None:
        """A request saw the replica fail: route nothing more to it until it answers again."""
        if self.core.set_healthy(replica_id, False):
            log.warning("replica %s failed a request: not routed to until healthy", replica_id)

    async def health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self._check(r) for r in list(self.core.replicas.values())),
                                 return_exceptions=True)
            await asyncio.sleep(self.health_interval)

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(g.stop() for g in self.groups.values()), return_exceptions=True)
        self.groups.clear()


def listed_capabilities(info: dict) -> tuple[str, ...]:
    """An engine's /v1/models `capabilities` (names only; anything else listed is ignored)."""
    found = info.get("capabilities")
    if not isinstance(found, list):
        return ()
    return tuple(name for name in found if isinstance(name, str) and len(name) <= 64)
