"""A client that goes away (streaming or not) has its engine requests aborted and its
in-flight slots released. Drives the ASGI app directly to control the disconnect."""
import asyncio
import json

import pytest

from pagedserve.pipeline.ingress import build_app
from pagedserve.pipeline.ingress.testing import make_test_context


class FakeConnection:
    """One HTTP request over ASGI whose client disconnects when `drop()` is called."""

    def __init__(self, app, path: str, body: dict):
        self.app = app
        self.body = json.dumps(body).encode()
        self.scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
                      "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
                      "raw_path": path.encode(), "query_string": b"", "root_path": "",
                      "headers": [(b"content-type", b"application/json"),
                                  (b"content-length", str(len(self.body)).encode())],
                      "client": ("127.0.0.1", 40000), "server": ("test", 80)}
        self.gone = asyncio.Event()
        self.body_sent = False
        self.sent: list[dict] = []
        self.chunks = 0

    async def receive(self):
        if not self.body_sent:
            self.body_sent = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message):
        if self.gone.is_set():
            return  # like uvicorn: sending to a closed connection is silently dropped
        self.sent.append(message)
        if message["type"] == "http.response.body" and message.get("body"):
            self.chunks += 1

    def drop(self):
        self.gone.set()

    def start(self):
        return asyncio.ensure_future(self.app(self.scope, self.receive, self.send))


async def wait_for(predicate, timeout=5.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.005)


STREAMING = [("/v1/completions", {"prompt": "Hello", "max_tokens": 500, "stream": True}),
             ("/v1/completions", {"prompt": ["a", "b"], "n": 2, "max_tokens": 500, "stream": True}),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                       "max_tokens": 500, "stream": True})]


@pytest.mark.parametrize("path,body", STREAMING, ids=["completion", "two-prompts", "chat"])
def test_streaming_client_drop_aborts(path, body):
    async def main():
        ctx, engine = make_test_context(max_model_len=1024, step_delay=0.002)
        conn = FakeConnection(build_app(ctx), path, body)
        task = conn.start()
        await wait_for(lambda: conn.chunks >= 3)
        assert engine.running and engine.aborted == []
        conn.drop()
        await asyncio.wait_for(task, 5)
        assert engine.running == set()
        assert sorted(engine.aborted) == sorted(s.request_id for s in engine.submitted)
        assert len(engine.aborted) == (2 if isinstance(body.get("prompt"), list) else 1)
        assert engine.finished == []
        assert ctx.admission.in_flight == 0
    asyncio.run(main())


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 500}),
    ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 500}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 500}),
], ids=["completion", "two-prompts", "chat"])
def test_non_streaming_client_drop_aborts(path, body):
    async def main():
        ctx, engine = make_test_context(max_model_len=1024, step_delay=0.002)
        conn = FakeConnection(build_app(ctx), path, body)
        task = conn.start()
        await wait_for(lambda: len(engine.running) == len(engine.submitted) > 0)
        await asyncio.sleep(0.02)
        conn.drop()
        await asyncio.wait_for(task, 5)
        assert engine.running == set() and engine.finished == []
        assert sorted(engine.aborted) == sorted(s.request_id for s in engine.submitted)
        assert ctx.admission.in_flight == 0
    asyncio.run(main())


def test_streaming_client_drop_before_first_token_aborts():
    async def main():
        ctx, engine = make_test_context(max_model_len=1024, step_delay=30.0)  # no token soon
        conn = FakeConnection(build_app(ctx), "/v1/completions",
                              {"prompt": "Hello", "max_tokens": 5, "stream": True})
        task = conn.start()
        await wait_for(lambda: engine.running)
        conn.drop()
        await asyncio.wait_for(task, 5)
        assert engine.aborted == [engine.submitted[0].request_id]
        assert ctx.admission.in_flight == 0
    asyncio.run(main())


def test_finished_stream_aborts_nothing():
    async def main():
        ctx, engine = make_test_context()
        conn = FakeConnection(build_app(ctx), "/v1/completions",
                              {"prompt": "Hello", "max_tokens": 4, "stream": True, "n": 2})
        await asyncio.wait_for(conn.start(), 5)
        assert engine.aborted == [] and len(engine.finished) == 1
        assert conn.sent[0]["status"] == 200
        assert conn.sent[-2]["body"] == b"data: [DONE]\n\n"
        assert ctx.admission.in_flight == 0
    asyncio.run(main())
