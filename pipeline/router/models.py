"""Loading models on demand: the service side of `ModelSlots`. A request for a model that is
not loaded waits (bounded) while its groups start, after the least recently used idle model's
groups stopped if the slots are full; cold starts are timed into the metrics."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from pagedserve.pipeline.router.groups import GroupSpec
from pagedserve.pipeline.router.metrics import RouterMetrics
from pagedserve.pipeline.router.model_slots import ModelSlots, ModelState
from pagedserve.pipeline.router.pool import ReplicaPool

log = logging.getLogger("pagedserve.router")


class ModelUnavailable(Exception):
    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = retry_after


class ModelManager:
    def __init__(self, specs: dict[str, GroupSpec], slots: ModelSlots, pool: ReplicaPool,
                 metrics: RouterMetrics, *, load_timeout: float = 120.0,
                 clock: Callable[[], float] = time.monotonic):
        self.specs = specs
        self.slots = slots
        self.pool = pool
        self.metrics = metrics
        self.load_timeout = load_timeout
        self.clock = clock
        self._changed = asyncio.Condition()
        self._errors: dict[str, tuple[float, str]] = {}
        self.cold_starts: dict[str, float] = {}   # the last load of each model, seconds
        self._tasks: set[asyncio.Task] = set()

    async def acquire(self, model: str) -> None:
        """Return once `model` is loaded, with one more request counted on it (it is not
        evicted until `release`); ModelUnavailable (503 + Retry-After) when it is not loaded
        within the load timeout or its load failed; KeyError for a model not served."""
        asked = self.clock()
        deadline = asked + self.load_timeout
        async with self._changed:
            while True:
                plan = self.slots.plan(model)
                if plan.ready:
                    self.slots.begin(model, self.clock())
                    return
                failed = self._errors.get(model)
                if failed is not None and failed[0] >= asked:
                    raise ModelUnavailable(f"model {model!r} failed to load: {failed[1]}", 30)
                if plan.load is not None:
                    self.slots.loading(plan.load)
                    if plan.evict is not None:
                        self.slots.unloading(plan.evict)
                    task = asyncio.ensure_future(self._load(plan.load, plan.evict))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                left = deadline - self.clock()
                if left <= 0:
                    raise ModelUnavailable(
                        f"model {model!r} is {self.slots.state(model).value}: not ready within "
                        f"{self.load_timeout:.0f} s (--load-timeout); retry later", 10)
                try:
                    await asyncio.wait_for(self._changed.wait(), left)
                except asyncio.TimeoutError:
                    pass

    async def _load(self, model: str, evict: str | None) -> None:
        if evict is not None:
            log.info("evicting model %s (least recently used) to load %s", evict, model)
            try:
                await self.pool.stop_model(evict)
            finally:
                self.metrics.model_evictions.labels(evict).inc()
                self.metrics.model_loaded.labels(evict).set(0)
                await self._set(lambda: self.slots.unloaded(evict))
        started = self.clock()
        log.info("loading model %s", model)
        try:
            await self.pool.start_model(self.specs[model])
        except Exception as exc:
            log.error("loading model %s failed: %s", model, exc)
            self._errors[model] = (self.clock(), str(exc))
            await self._set(lambda: self.slots.unloaded(model))
            return
        seconds = self.clock() - started
        self.cold_starts[model] = seconds
        self.metrics.model_loads.labels(model).inc()
        self.metrics.cold_start.labels(model).observe(seconds)
        self.metrics.model_loaded.labels(model).set(1)
        log.info("model %s loaded in %.1f s", model, seconds)
        await self._set(lambda: self.slots.loaded(model, self.clock()))

    async def _set(self, change: Callable[[], None]) -> None:
        async with self._changed:
            change()
            self._changed.notify_all()

    async def release(self, model: str) -> None:
        """A request on `model` finished: a request waiting for its slot may go now."""
        await self._set(lambda: self.slots.end(model, self.clock()))

    def mark_loaded(self, model: str) -> None:
        """A model served by remote engines: always loaded."""
        self.slots.loaded(model, self.clock())
        self.metrics.model_loaded.labels(model).set(1)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def state(self, model: str) -> ModelState:
        return self.slots.state(model)
