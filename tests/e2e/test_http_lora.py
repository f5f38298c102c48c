"""LoRA over HTTP on a launched group (tiny random Llama, random PEFT adapters): adapters listed
in /v1/models under their base, selected by `model`; loaded, used, unloaded and loaded again
while 32 streams run, none lost and each adapter's stream the same tokens before and after
its reload; served again by a restarted ingress; the endpoints behind the API key, bad input
refused naming the cause."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from faults.conftest import Group
from pagedserve.pipeline.ingress.testing import make_tiny_tokenizer
from pagedserve.workers.lora.testing import make_peft_adapter
from pagedserve.workers.testing import make_tiny_llama

KEY = "lora-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TOKENS = 64


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-http")
    base = make_tiny_llama(root / "base", seed=5, vocab_size=259)
    make_tiny_tokenizer().save_pretrained(base)
    first = make_peft_adapter(base, root / "first", rank=8, seed=1)
    hot = make_peft_adapter(base, root / "hot", rank=8, seed=2)
    group = Group(base, http=True, extra=(
        "--served-model-name", "base", "--api-key", KEY, "--enable-lora", "--max-loras", "2",
        "--max-lora-rank", "8", "--lora-modules", f"first={first}", "--max-num-seqs", "32"))
    yield group, hot, root
    group.close()


async def _stream(client: httpx.AsyncClient, model: str, prompt: str,
                  started: asyncio.Event | None = None) -> tuple[list[str], str]:
    """The text pieces of one streamed completion and its finish reason (`started` is set at
    its first piece)."""
    body = {"model": model, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}
    pieces, finish = [], None
    async with client.stream("POST", "/v1/completions", json=body, headers=AUTH) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            pieces.append(choice["text"])
            if started is not None:
                started.set()
            finish = choice["finish_reason"] or finish
    return pieces, finish


def test_models_lists_adapters_under_their_base(served):
    group, _, _ = served
    url = f"http://127.0.0.1:{group.port}"
    models = httpx.get(f"{url}/v1/models", headers=AUTH).json()["data"]
    assert [(m["id"], m["parent"]) for m in models] == [("base", None), ("first", "base")]
    missing = httpx.post(f"{url}/v1/completions", headers=AUTH,
                         json={"model": "nope", "prompt": "hi", "max_tokens": 1})
    assert missing.status_code == 404 and "'first'" in missing.json()["error"]["message"]
    chats = [httpx.post(f"{url}/v1/chat/completions", headers=AUTH, json={
        "model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8,
        "temperature": 0, "ignore_eos": True}).json() for model in ("first", "base")]
    assert [c["usage"]["completion_tokens"] for c in chats] == [8, 8]
    assert chats[0]["choices"][0]["message"] != chats[1]["choices"][0]["message"]


def test_load_endpoints_are_behind_the_key_and_check_their_input(served):
    group, hot, root = served
    url = f"http://127.0.0.1:{group.port}/v1"
    body = {"lora_name": "x", "lora_path": str(hot)}
    assert httpx.post(f"{url}/load_lora_adapter", json=body).status_code == 401
    relative = httpx.post(f"{url}/load_lora_adapter", headers=AUTH,
                          json={"lora_name": "x", "lora_path": "hot"})
    assert relative.status_code == 400 and "must be absolute" in relative.text
    wide = make_tiny_llama(root / "wide", hidden_size=96, vocab_size=259)
    misfit = make_peft_adapter(wide, root / "misfit", rank=8, seed=3)
    refused = httpx.post(f"{url}/load_lora_adapter", headers=AUTH,
                         json={"lora_name": "x", "lora_path": str(misfit)})
    assert refused.status_code == 400 and "do not fit the model's" in refused.text
    taken = httpx.post(f"{url}/load_lora_adapter", headers=AUTH,
                       json={"lora_name": "base", "lora_path": str(hot)})
    assert taken.status_code == 400 and "base model's name" in taken.text
    gone = httpx.post(f"{url}/unload_lora_adapter", headers=AUTH, json={"lora_name": "x"})
    assert gone.status_code == 404


def test_load_use_unload_reload_while_32_streams_run(served):
    group, hot, _ = served

    async def run() -> None:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{group.port}",
                                     timeout=300) as client:
            load = {"lora_name": "hot", "lora_path": str(hot)}
            assert (await client.post("/v1/load_lora_adapter", json=load,
                                      headers=AUTH)).status_code == 200
            models = ["base", "first", "hot", "hot"] * 8
            started = [asyncio.Event() for _ in models]
            streams = [asyncio.ensure_future(_stream(client, m, f"prompt {i % 3}", started[i]))
                       for i, m in enumerate(models)]
            await asyncio.gather(*(event.wait() for event in started))
            assert not any(s.done() for s, m in zip(streams, models) if m == "hot")
            metrics = (await client.get("/metrics")).text
            info = next(line for line in metrics.splitlines()
                        if line.startswith("vllm:lora_requests_info{"))
            assert 'max_lora="2"' in info and 'running_lora_adapters="first,hot"' in info
            unload = await client.post("/v1/unload_lora_adapter", json={"lora_name": "hot"},
                                       headers=AUTH)
            assert unload.status_code == 200
            refused = await client.post("/v1/completions", headers=AUTH, json={
                "model": "hot", "prompt": "x", "max_tokens": 1})
            assert refused.status_code == 404
            assert (await client.post("/v1/load_lora_adapter", json=load,
                                      headers=AUTH)).status_code == 200
            again = await _stream(client, "hot", "prompt 2")
            results = await asyncio.gather(*streams)
        assert all(finish == "length" and len(pieces) >= TOKENS - 1
                   for pieces, finish in results), results
        by_model: dict[tuple[str, int], set[str]] = {}
        for i, (model, (pieces, _)) in enumerate(zip(models, results)):
            by_model.setdefault((model, i % 3), set()).add("".join(pieces))
        assert all(len(texts) == 1 for texts in by_model.values())   # greedy: one text each
        assert {"".join(again[0])} == by_model["hot", 2]               # the reload is the same
        assert by_model["hot", 0] != by_model["base", 0] != by_model["first", 0]

    asyncio.run(run())


def test_a_restarted_ingress_serves_the_adapters_loaded_at_run_time(served):
    group, hot, _ = served
    url = f"http://127.0.0.1:{group.port}"
    body = {"model": "hot", "prompt": "prompt 1", "max_tokens": 8, "temperature": 0}
    if "hot" not in {m["id"] for m in httpx.get(f"{url}/v1/models", headers=AUTH).json()["data"]}:
        assert httpx.post(f"{url}/v1/load_lora_adapter", headers=AUTH, json={
            "lora_name": "hot", "lora_path": str(hot)}).status_code == 200
    before = httpx.post(f"{url}/v1/completions", headers=AUTH, json=body).json()
    group.kill("ingress")
    group.wait_http(120)
    models = httpx.get(f"{url}/v1/models", headers=AUTH).json()["data"]
    assert {(m["id"], m["parent"]) for m in models} == {("base", None), ("first", "base"),
                                                       ("hot", "base")}
    after = httpx.post(f"{url}/v1/completions", headers=AUTH, json=body).json()
    assert after["choices"][0]["text"] == before["choices"][0]["text"]
