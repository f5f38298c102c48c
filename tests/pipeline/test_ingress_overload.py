"""Overload: 503 + Retry-After, decided before tokenization; engine errors keep their status."""
import asyncio

import httpx

from pagedserve.pipeline.ingress import build_app
from pagedserve.pipeline.ingress.admission import REJECT_BACKOFF_S, AdmissionController
from pagedserve.pipeline.ingress.testing import make_test_context
from pagedserve.pipeline.outputs import RequestError

MSGS = [{"role": "user", "content": "hi"}]


class CountingTokenizer:
    """Wraps a tokenizer and counts the calls that cost tokenization time."""

    def __init__(self, inner):
        self._inner = inner
        self.calls = 0

    def encode(self, *args, **kwargs):
        self.calls += 1
        return self._inner.encode(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        self.calls += 1
        return self._inner.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __len__(self):
        return len(self._inner)


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def run(test, **kwargs):
    async def main():
        ctx, engine = make_test_context(**kwargs)
        ctx.tokenizer = CountingTokenizer(ctx.tokenizer)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(ctx)),
                                     base_url="http://test") as client:
            await test(client, ctx, engine)
    asyncio.run(main())


def assert_overloaded(r):
    assert r.status_code == 503, r.text
    assert r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "overloaded"


def test_admission_controller_rules():
    a = AdmissionController(max_queued_requests=2, max_num_seqs=1)
    assert a.capacity == 3
    assert a.refusal(3, now=0.0) is None
    assert "in flight" in a.refusal(4, now=0.0)
    a.enter(3)
    assert a.refusal(1, now=0.0) is not None
    a.leave(1)
    assert a.refusal(1, now=0.0) is None
    a.observe_stats({"num_requests_waiting": 2}, now=10.0)
    assert "queue is full" in a.refusal(1, now=11.0)
    assert a.refusal(1, now=13.0) is None  # the snapshot went stale
    a.observe_rejection(now=20.0)
    assert "refused" in a.refusal(1, now=20.1)
    a.observe_stats({"num_requests_waiting": 0}, now=20.2)
    assert a.refusal(1, now=20.3) is None  # fresher stats say there is room
    a.observe_rejection(now=30.0)
    assert a.refusal(1, now=30.0 + REJECT_BACKOFF_S + 0.01) is None


def test_local_in_flight_limit_refuses_without_tokenizing():
    async def t(client, ctx, engine):
        long = [asyncio.ensure_future(client.post("/v1/completions", json={
            "prompt": f"p{i}", "max_tokens": 40, "ignore_eos": True})) for i in range(3)]
        while len(engine.running) < 3:
            await asyncio.sleep(0.01)
        calls = ctx.tokenizer.calls
        assert_overloaded(await client.post("/v1/completions", json={"prompt": "x"}))
        assert_overloaded(await client.post("/v1/chat/completions", json={"messages": MSGS}))
        assert ctx.tokenizer.calls == calls and len(engine.submitted) == 3
        assert [r.status_code for r in await asyncio.gather(*long)] == [200] * 3
        assert ctx.admission.in_flight == 0
        r = await client.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 1})
        assert r.status_code == 200
        # one HTTP request with several prompts needs one slot per prompt: refused while
        # others hold slots; a batch larger than the engine's queue, which it reaches at once,
        # is a 400 (a retry after a 503 would fail forever)
        hold = [asyncio.ensure_future(client.post("/v1/completions", json={
            "prompt": f"p{i}", "max_tokens": 40, "ignore_eos": True})) for i in range(2)]
        while len(engine.running) < 2:
            await asyncio.sleep(0.01)
        assert_overloaded(await client.post("/v1/completions", json={"prompt": ["a", "b"]}))
        assert [(await h).status_code for h in hold] == [200, 200]
        r = await client.post("/v1/completions", json={"prompt": ["a", "b", "c"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    run(t, max_queued_requests=2, max_num_seqs=1, step_delay=0.01)


def test_engine_503_maps_to_503_and_backs_off_locally():
    async def t(client, ctx, engine):
        ctx.clock = clock = FakeClock()
        engine.reject = RequestError(503, "the scheduler's queue is full (4 waiting)")
        r = await client.post("/v1/completions", json={"prompt": "x"})
        assert_overloaded(r)
        assert "queue is full" in r.json()["error"]["message"]
        assert len(engine.submitted) == 1
        engine.reject = None
        calls = ctx.tokenizer.calls
        clock.now += REJECT_BACKOFF_S / 2  # still backing off: refused before tokenizing
        assert_overloaded(await client.post("/v1/completions", json={"prompt": "x"}))
        assert ctx.tokenizer.calls == calls and len(engine.submitted) == 1
        clock.now += REJECT_BACKOFF_S
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 200
    run(t)


def test_full_queue_in_stats_snapshot_refuses_before_tokenizing():
    async def t(client, ctx, engine):
        engine.stats_result = {"num_requests_waiting": 8}
        assert (await client.get("/metrics")).status_code == 200  # refreshes the snapshot
        calls = ctx.tokenizer.calls
        assert_overloaded(await client.post("/v1/chat/completions", json={"messages": MSGS}))
        assert ctx.tokenizer.calls == calls and engine.submitted == []
        engine.stats_result = {"num_requests_waiting": 0}
        await client.get("/metrics")
        r = await client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1})
        assert r.status_code == 200
    run(t, max_queued_requests=8)


def test_streaming_request_refused_by_engine_gets_http_status_not_a_200_stream():
    async def t(client, ctx, engine):
        ctx.clock = clock = FakeClock()
        engine.reject = RequestError(503, "draining")
        r = await client.post("/v1/chat/completions", json={"messages": MSGS, "stream": True})
        assert_overloaded(r)
        clock.now += 2 * REJECT_BACKOFF_S
        engine.reject = RequestError(400, "prompt needs 900 blocks but the pool has 64")
        r = await client.post("/v1/completions", json={"prompt": "x", "stream": True})
        assert r.status_code == 400 and "900 blocks" in r.json()["error"]["message"]
        assert ctx.admission.in_flight == 0
    run(t)


def test_engine_failure_mid_stream_is_an_error_event():
    async def t(client, ctx, engine):
        original = engine.generate

        async def failing(*args, **kwargs):
            async for i, delta in _enumerate(original(*args, **kwargs)):
                if i == 2:
                    raise RequestError(503, "worker 0 died")
                yield delta
        engine.generate = failing
        r = await client.post("/v1/completions", json={"prompt": "x", "stream": True,
                                                       "max_tokens": 5})
        assert r.status_code == 200
        blocks = r.text.split("\n\n")
        assert blocks[-2] == "data: [DONE]"
        assert '"error"' in blocks[-3] and "worker 0 died" in blocks[-3]
        engine.generate = original
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 5})
        assert r.status_code == 200
        assert ctx.admission.in_flight == 0
    run(t)


async def _enumerate(agen):
    i = 0
    async for x in agen:
        yield i, x
        i += 1
