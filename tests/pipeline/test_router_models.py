"""Loading models on demand (ModelManager over a fake pool): a request waits while its model
loads, the least recently used idle model is stopped first, a load that takes too long is a
503 with Retry-After, a failed load names its cause. Remote engines join by URL."""
import asyncio
import json

import httpx
import pytest

from pagedserve.pipeline.router.core import RouterCore
from pagedserve.pipeline.router.groups import GroupSpec
from pagedserve.pipeline.router.metrics import RouterMetrics
from pagedserve.pipeline.router.model_slots import ModelSlots
from pagedserve.pipeline.router.models import ModelManager, ModelUnavailable
from pagedserve.pipeline.router.pool import ReplicaPool


class FakePool:
    def __init__(self, load_seconds=0.01, fail=()):
        self.events = []
        self.load_seconds = load_seconds
        self.fail = set(fail)

    async def start_model(self, spec):
        self.events.append(("start", spec.model))
        await asyncio.sleep(self.load_seconds)
        if spec.model in self.fail:
            raise RuntimeError(f"engine group {spec.model}/0 exited with code 2")

    async def stop_model(self, model):
        self.events.append(("stop", model))


def manager(pool, models=("a", "b"), max_loaded=1, load_timeout=5.0):
    specs = {m: GroupSpec(m, f"/models/{m}") for m in models}
    return ModelManager(specs, ModelSlots(list(models), max_loaded), pool, RouterMetrics(),
                        load_timeout=load_timeout)


def test_requests_wait_for_a_load_and_evict_the_idle_model():
    pool = FakePool()

    async def run():
        mm = manager(pool)
        await asyncio.gather(mm.acquire("a"), mm.acquire("a"))  # one load, both wait for it
        busy_b = asyncio.ensure_future(mm.acquire("b"))
        await asyncio.sleep(0.05)
        assert not busy_b.done()  # a has requests in flight: not evicted
        await mm.release("a")
        await mm.release("a")
        await busy_b
        await mm.release("b")
        return mm

    mm = asyncio.run(run())
    assert pool.events == [("start", "a"), ("stop", "a"), ("start", "b")]
    assert set(mm.cold_starts) == {"a", "b"}
    assert mm.state("a").value == "unloaded" and mm.state("b").value == "loaded"


def test_a_slow_load_is_a_503_with_retry_after_and_a_failed_one_names_its_cause():
    async def run():
        slow = manager(FakePool(load_seconds=0.5), load_timeout=0.05)
        with pytest.raises(ModelUnavailable, match="loading") as waited:
            await slow.acquire("a")
        assert waited.value.retry_after > 0
        await asyncio.sleep(0.6)
        await slow.acquire("a")  # the load went on and finished
        broken = manager(FakePool(fail={"b"}))
        with pytest.raises(ModelUnavailable, match="exited with code 2"):
            await broken.acquire("b")
        with pytest.raises(KeyError, match="not served"):
            await broken.acquire("zzz")

    asyncio.run(run())


def test_a_remote_engine_joins_by_its_url():
    def handler(request):
        if request.url.path == "/v1/models":
            return httpx.Response(200, content=json.dumps(
                {"data": [{"id": "remote-model", "max_model_len": 4096,
                           "capabilities": ["completion", "chat", 7, "tools"]}]}))
        return httpx.Response(200)

    async def run():
        core = RouterCore()
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            pool = ReplicaPool(core, RouterMetrics(), http)
            replica = await pool.add_remote("http://engine-a:8000/")
        return core, replica

    core, replica = asyncio.run(run())
    assert (replica.model, replica.max_model_len, replica.healthy) == ("remote-model", 4096, True)
    assert replica.capabilities == ("completion", "chat", "tools")  # names only
    assert core.pick("remote-model", b"k", 1).replica_id == "http://engine-a:8000"


def test_a_group_in_a_crash_loop_is_not_restarted_forever():
    now = [0.0]
    pool = ReplicaPool(RouterCore(), RouterMetrics(), None, max_restarts=2, restart_window=60,
                       clock=lambda: now[0])
    assert pool.may_restart("m/0") and pool.may_restart("m/0")
    assert not pool.may_restart("m/0") and not pool.may_restart("m/0")
    assert pool.may_restart("m/1")  # counted per group
    now[0] = 61.0
    assert pool.may_restart("m/0")  # the window moved on
