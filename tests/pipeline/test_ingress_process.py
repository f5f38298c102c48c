"""`python -m pagedserve.pipeline.ingress` as a real process against a fake engine speaking the real wire
(scheduler ROUTER + detokenizer ROUTER over ipc://): readiness to the launcher's control socket,
the openai SDK end to end, abort on a dropped stream, and a SIGTERM drain that finishes the
in-flight stream and exits 0."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import zmq

from pagedserve import transport
from pagedserve.pipeline import messages
from pagedserve.pipeline.config import EngineConfig, ModelInfo
from pagedserve.pipeline.ingress.testing import make_tiny_tokenizer

WIRE = transport.Codec(transport.message_types(messages))  # reads every message

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WireEngine(threading.Thread):
    """Answers Hello, health/stats calls and AddRequest (one letter per token every
    `token_interval` seconds, ending with "length"); records Aborts."""

    def __init__(self, cfg: EngineConfig, token_interval: float = 0.01):
        super().__init__(daemon=True)
        self.ctx = zmq.Context()
        self.frontend = transport.make_socket(self.ctx, zmq.ROUTER, cfg.ipc.frontend_addr, bind=True)
        self.output = transport.make_socket(self.ctx, zmq.ROUTER, cfg.ipc.output_addr, bind=True)
        self.token_interval = token_interval
        self.added: list[messages.AddRequest] = []
        self.aborted: list[str] = []
        self.active: dict[str, dict] = {}
        self._halt = threading.Event()

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.frontend, zmq.POLLIN)
        poller.register(self.output, zmq.POLLIN)
        next_step = time.monotonic()
        while not self._halt.is_set():
            for sock, _ in poller.poll(5):
                identity, msg = WIRE.recv_routed(sock)
                self.handle(identity, msg)
            if time.monotonic() >= next_step:
                self.step()
                next_step = time.monotonic() + self.token_interval
        self.frontend.close(0)
        self.output.close(0)
        self.ctx.term()

    def handle(self, identity: bytes, msg) -> None:
        if isinstance(msg, messages.Hello):
            transport.send(self.output, messages.HelloAck(identity), identity=identity)
        elif isinstance(msg, messages.UtilityCall):
            result = {"ok": True} if msg.method == "health" else {
                "num_requests_running": len(self.active), "num_requests_waiting": 0}
            transport.send(self.frontend, messages.UtilityReply(msg.call_id, result), identity=identity)
        elif isinstance(msg, messages.AddRequest):
            self.added.append(msg)
            self.active[msg.request_id] = {"client": identity, "req": msg, "done": 0}
        elif isinstance(msg, messages.Abort):
            self.aborted.extend(msg.request_ids)
            for rid in msg.request_ids:
                self.active.pop(rid, None)

    def step(self) -> None:
        for rid, st in list(self.active.items()):
            req, st["done"] = st["req"], st["done"] + 1
            last = st["done"] >= req.sampling.max_tokens
            deltas = [messages.TextDelta(
                request_id=rid, index=i, text="ab"[i % 2], token_ids=[97 + i % 2],
                token_offset=st["done"] - 1, text_offset=st["done"] - 1,
                finish_reason="length" if last else None,
                num_prompt_tokens=len(req.prompt_token_ids), num_output_tokens=st["done"])
                for i in range(req.sampling.n)]
            transport.send(self.output, messages.DeltaBatch(deltas), identity=st["client"])
            if last:
                del self.active[rid]

    def stop(self) -> None:
        self._halt.set()
        self.join(5)


@pytest.fixture
def group(tmp_path):
    model_dir = tmp_path / "tiny-model"
    make_tiny_tokenizer().save_pretrained(model_dir)
    (model_dir / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 259, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "hidden_act": "silu", "eos_token_id": 257}))
    cfg = EngineConfig.from_kwargs(model=str(model_dir), served_model_name="tiny",
                                   host="127.0.0.1", port=free_port(), ipc_dir=str(tmp_path))
    cfg.ipc.fill_defaults()
    # What the launcher would have resolved (this directory has no weights to load).
    cfg.model_info = ModelInfo(model_dir=str(model_dir), tokenizer_dir=str(model_dir),
                               architecture="llama", vocab_size=259, max_position_embeddings=256,
                               eos_token_ids=[257])
    engine = WireEngine(cfg)
    engine.start()
    zctx = zmq.Context()
    control = transport.make_socket(zctx, zmq.PULL, cfg.ipc.control_addr, bind=True)
    config_file = cfg.ipc.config_file("ingress", 0)
    cfg.to_file(config_file)
    proc = subprocess.Popen([sys.executable, "-m", "pagedserve.pipeline.ingress.process",
                             "--config-file", config_file, "--rank", "0"], cwd=ROOT)
    try:
        assert control.poll(120_000), "the ingress never reported ready"
        ready = WIRE.recv(control)
        assert isinstance(ready, messages.ProcessReady)
        assert (ready.role, ready.rank, ready.pid) == ("ingress", 0, proc.pid)
        yield cfg, engine, proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        engine.stop()
        control.close(0)
        zctx.term()


def test_ingress_process_serves_openai_sdk_and_drains_on_sigterm(group):
    from openai import OpenAI

    cfg, engine, proc = group
    base = f"http://127.0.0.1:{cfg.server.port}"
    client = OpenAI(base_url=f"{base}/v1", api_key="unused")
    out = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, n=2)
    assert [c.text for c in out.choices] == ["aaaa", "bbbb"]
    assert out.usage.completion_tokens == 8 and out.usage.prompt_tokens == 5
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True,
        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "aaa"
    assert chunks[-1].usage.completion_tokens == 3
    assert httpx.get(f"{base}/health").status_code == 200
    assert "vllm:num_requests_running" in httpx.get(f"{base}/metrics").text

    # A stream dropped mid-way is aborted in the engine.
    with httpx.stream("POST", f"{base}/v1/completions",
                      json={"prompt": "x", "max_tokens": 10_000 // 100, "stream": True}) as r:
        next(r.iter_lines())
    deadline = time.monotonic() + 10
    while not engine.aborted and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.aborted == [engine.added[-1].request_id]

    # SIGTERM while a stream runs: it finishes, then the process exits 0.
    lines = []
    with httpx.stream("POST", f"{base}/v1/completions",
                      json={"prompt": "x", "max_tokens": 60, "stream": True}, timeout=30) as r:
        for line in r.iter_lines():
            if line and not lines:
                os.kill(proc.pid, signal.SIGTERM)
            if line:
                lines.append(line)
    assert lines[-1] == "data: [DONE]"
    assert sum(1 for x in lines if x.startswith("data: {")) == 60
    assert proc.wait(30) == 0
    assert len(engine.aborted) == 1
