"""The client library against a fake engine: a request is sent only once the client knows which
scheduler instance takes it, and is sent again, flagged, when a new instance answers.

Found by CI: a scheduler that died before answering the client's first health call took the
batch along; the client took its successor for the first instance and never resubmitted, and
the streams waited forever (tests/faults/test_injected_faults.py timed out at 900 s)."""
from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from pagedserve import transport
from pagedserve.pipeline import messages
from pagedserve.pipeline.client import AsyncEngineClient
from pagedserve.pipeline.sampling_params import SamplingParams

WIRE = transport.Codec(transport.message_types(messages))  # reads every message


class FakeEngine:
    """A scheduler ROUTER that answers health calls only once told its instance, and a
    detokenizer ROUTER that answers hellos and sends deltas."""

    def __init__(self, tmp_path):
        self.ctx = zmq.asyncio.Context()
        self.frontend_addr = f"ipc://{tmp_path}/frontend.sock"
        self.output_addr = f"ipc://{tmp_path}/output.sock"
        self.frontend = transport.make_socket(self.ctx, zmq.ROUTER, self.frontend_addr, bind=True)
        self.output = transport.make_socket(self.ctx, zmq.ROUTER, self.output_addr, bind=True)
        self.instance: str | None = None  # None: the scheduler is down or still starting
        self.adds: list[messages.AddRequest] = []
        self.health_calls = 0
        self.tasks = [asyncio.ensure_future(self._serve_frontend()),
                      asyncio.ensure_future(self._serve_output())]

    async def _serve_frontend(self) -> None:
        while True:
            client, *frames = await self.frontend.recv_multipart()
            msg = WIRE.decode(frames)
            if isinstance(msg, messages.AddRequest):
                self.adds.append(msg)
            elif isinstance(msg, messages.UtilityCall) and msg.method == "health":
                self.health_calls += 1
                if self.instance is not None:
                    reply = messages.UtilityReply(msg.call_id, result={
                        "ok": True, "draining": False, "instance": self.instance, "down": {}})
                    transport.send(self.frontend, reply, identity=client)

    async def _serve_output(self) -> None:
        while True:
            client, *frames = await self.output.recv_multipart()
            if isinstance(WIRE.decode(frames), messages.Hello):
                transport.send(self.output, messages.HelloAck(client), identity=client)

    def finish(self, client: bytes, request_id: str) -> None:
        transport.send(self.output, messages.DeltaBatch([messages.TextDelta(
            request_id=request_id, index=0, text="hi", token_ids=[7], finish_reason="stop")]),
            identity=client)

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        self.frontend.close(0)
        self.output.close(0)
        self.ctx.term()


async def until(predicate, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_a_request_waits_for_the_first_answer_and_follows_a_restart(tmp_path):
    async def main():
        engine = FakeEngine(tmp_path)
        client = await AsyncEngineClient(engine.frontend_addr, engine.output_addr,
                                         connect_timeout=10).connect()
        try:
            stream = client.generate([1, 2, 3], SamplingParams(max_tokens=4), request_id="r1")
            first = asyncio.ensure_future(stream.__anext__())
            await until(lambda: engine.health_calls >= 1)
            await asyncio.sleep(0.3)
            assert engine.adds == [], "sent before any scheduler instance answered"
            engine.instance = "A"
            await until(lambda: len(engine.adds) == 1)
            assert engine.adds[0].resubmitted is False
            engine.instance = "B"  # restarted: A's requests are gone
            await until(lambda: len(engine.adds) == 2)
            again = engine.adds[1]
            assert (again.request_id, again.resubmitted) == ("r1", True)
            assert again.prompt_token_ids == [1, 2, 3]
            engine.finish(client.client_id, "r1")
            delta = await asyncio.wait_for(first, 10)
            assert (delta.token_ids, delta.finish_reason) == ([7], "stop")
            await stream.aclose()
        finally:
            await client.close()
            engine.close()

    asyncio.run(main())
