"""What a client may make the ingress hold: 64 KiB of headers or a 64 KiB URL (which uvicorn's
h11 passes through when they arrive in one read) and a body trickled forever are refused with
OpenAI-shaped 4xx, and the next request is served."""
import asyncio

import httpx
import pytest

from pagedserve.pipeline.ingress import build_app, limits
from pagedserve.pipeline.ingress.testing import make_test_context

GOOD = {"prompt": "Hello", "max_tokens": 2}


def run(test):
    async def main():
        ctx, engine = make_test_context()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(ctx)),
                                     base_url="http://test") as client:
            await test(client, ctx, engine)
            assert (await client.post("/v1/completions", json=GOOD)).status_code == 200
    asyncio.run(main())


@pytest.mark.parametrize("headers", [{"X-Big": "a" * 65536},
                                     {f"X-Many-{i}": "b" * 54 for i in range(1024)}],
                         ids=["one 64 KiB header", "1024 headers of 64 bytes"])
def test_oversized_headers_are_431(headers):
    async def t(client, ctx, engine):
        r = await client.post("/v1/completions", json=GOOD, headers=headers)
        assert r.status_code == 431
        assert r.json()["error"]["code"] == "headers_too_large"
        assert "at most 16384" in r.json()["error"]["message"]
        assert engine.submitted == []
        ok = await client.post("/v1/completions", json=GOOD,
                               headers={"X-Fine": "c" * (limits.MAX_HEADER_BYTES // 2)})
        assert ok.status_code == 200
    run(t)


def test_oversized_url_is_414():
    async def t(client, ctx, engine):
        r = await client.get("/v1/models?" + "q" * 20000)  # httpx itself refuses 64 KiB
        assert r.status_code == 414 and r.json()["error"]["code"] == "uri_too_long"
        assert (await client.get("/v1/models?" + "q" * 1000)).status_code == 200
    run(t)


def test_a_body_trickled_past_the_timeout_is_408_and_holds_nothing(monkeypatch):
    monkeypatch.setattr(limits, "BODY_TIMEOUT_S", 0.3)

    async def t(client, ctx, engine):
        async def trickle():
            for byte in b'{"prompt": "Hello", "max_tokens": 2}':
                yield bytes([byte])
                await asyncio.sleep(0.1)
        r = await client.post("/v1/completions", content=trickle(),
                              headers={"content-type": "application/json"})
        assert r.status_code == 408 and r.json()["error"]["code"] == "request_timeout"
        assert engine.submitted == [] and ctx.admission.in_flight == 0
    run(t)
