"""The router's HTTP face over fake replicas: keys (401), unknown models (404), a key's rate
limit (429 + Retry-After), a streamed request passed through with the token ids stripped."""
import asyncio
import json

import httpx

from pagedserve.pipeline.router.app import build_router_app
from pagedserve.pipeline.router.ratelimit import KeyLimit, RateLimiter
from test_router_resume import chat_chunks, make_service, sse


def test_keys_models_limits_and_a_stream_through_the_app():
    def handler(request):
        return httpx.Response(200, content=sse(chat_chunks(0, 6, finish_at=5) + ["[DONE]"]))

    async def run():
        service, _, metrics = make_service(handler)
        service.limiter = RateLimiter({"slow": KeyLimit(requests_per_minute=60)}, burst_seconds=1)
        app = build_router_app(service, ["fast", "slow"])
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://router") as client:
            chat = {"messages": [{"role": "user", "content": "hi"}], "stream": True}

            def post(key, body):
                return client.post("/v1/chat/completions", json=body,
                                   headers={"Authorization": f"Bearer {key}"} if key else {})
            assert (await post(None, chat)).status_code == 401
            assert (await post("nope", chat)).status_code == 401
            missing = await post("fast", {**chat, "model": "other"})
            assert missing.status_code == 404 and "other" in missing.json()["error"]["message"]
            streamed = await post("fast", chat)
            assert (await post("slow", chat)).status_code == 200
            limited = await post("slow", chat)
            assert limited.status_code == 429 and limited.headers["Retry-After"] == "1"
            service.core.replicas["m/1"].capabilities = ("completion", "chat", "insert")
            models = (await client.get("/v1/models", headers={"Authorization": "Bearer fast"}))
            return streamed, models.json(), metrics

    streamed, models, metrics = asyncio.run(run())
    assert streamed.status_code == 200
    events = [json.loads(block[6:]) for block in streamed.text.split("\n\n")
              if block.startswith("data: {")]
    assert "".join(c["delta"].get("content", "") for e in events for c in e["choices"]) == \
        "a b c d e f"
    assert all("token_ids" not in c and "prompt_token_ids" not in e
               for e in events for c in e["choices"])
    assert streamed.text.endswith("data: [DONE]\n\n")
    assert [m["id"] for m in models["data"]] == ["m"]
    (card,) = models["data"]
    assert card["capabilities"] == ["completion", "chat", "insert"] and card["max_model_len"] == 100
    assert metrics.rejected.labels("unauthorized")._value.get() == 2


def test_tokenize_detokenize_and_infill_are_forwarded_behind_the_keys():
    seen = []
    infill_events = [{"index": 0, "content": "x", "stop": False, "tokens_predicted": 1,
                      "tokens_evaluated": 5},
                     {"index": 0, "content": "", "stop": True, "stop_type": "limit",
                      "tokens_predicted": 1, "tokens_evaluated": 5}]

    def handler(request):
        body = json.loads(request.content)
        seen.append((request.url.path, body))
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"count": 1, "max_model_len": 100, "tokens": [7]})
        if request.url.path == "/detokenize":
            return httpx.Response(200, json={"prompt": "hi"})
        if body.get("stream"):  # llama.cpp's stream: no [DONE]
            return httpx.Response(200, content=b"".join(
                b"data: " + json.dumps(e).encode() + b"\n\n" for e in infill_events))
        return httpx.Response(200, json={**infill_events[-1], "content": "x"})

    async def run():
        service, _, metrics = make_service(handler)
        app = build_router_app(service, ["k"])
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://router") as client:
            auth = {"Authorization": "Bearer k"}
            assert (await client.post("/tokenize", json={"prompt": "hi"})).status_code == 401
            tokenized = await client.post("/tokenize", json={"prompt": "hi", "stream": True},
                                          headers=auth)
            text = await client.post("/detokenize", json={"tokens": [7]}, headers=auth)
            missing = await client.post("/detokenize", json={"model": "x", "tokens": [7]},
                                        headers=auth)
            infill = await client.post("/infill", json={"input_prefix": "a", "n_predict": 4},
                                       headers=auth)
            streamed = await client.post("/infill", json={"input_prefix": "a", "stream": True},
                                         headers=auth)
            return tokenized, text, missing, infill, streamed

    tokenized, text, missing, infill, streamed = asyncio.run(run())
    assert tokenized.json()["tokens"] == [7] and text.json() == {"prompt": "hi"}
    assert missing.status_code == 404
    assert infill.json()["content"] == "x" and infill.json()["stop"] is True
    assert streamed.status_code == 200 and "[DONE]" not in streamed.text
    events = [json.loads(b[6:]) for b in streamed.text.split("\n\n") if b.startswith("data: ")]
    assert [e["stop"] for e in events] == [False, True]
    assert [path for path, _ in seen] == ["/tokenize", "/detokenize", "/infill", "/infill"]
    assert all(body["model"] == "m" for _, body in seen)  # the served model filled in


def test_embeddings_are_forwarded_behind_the_keys_and_charged_their_input():
    from pagedserve.pipeline.router.prompts import affinity_prompt, estimate_tokens
    seen = []
    answer = {"object": "list", "data": [{"object": "embedding", "index": 0,
                                          "embedding": [0.6, 0.8]}],
              "model": "m", "usage": {"prompt_tokens": 3, "total_tokens": 3}}

    def handler(request):
        seen.append((request.url.path, json.loads(request.content)))
        return httpx.Response(200, json=answer)

    async def run():
        service, _, _ = make_service(handler)
        service.limiter = RateLimiter({"k": KeyLimit(tokens_per_minute=600)}, burst_seconds=1)
        app = build_router_app(service, ["k"])
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://router") as client:
            body = {"input": ["hello there", "second"]}
            assert (await client.post("/v1/embeddings", json=body)).status_code == 401
            got = await client.post("/v1/embeddings", json=body,
                                    headers={"Authorization": "Bearer k"})
            return got
    got = asyncio.run(run())
    assert got.status_code == 200 and got.json() == answer
    assert seen == [("/v1/embeddings", {"input": ["hello there", "second"], "model": "m"})]
    # the input is the affinity key and the charge; an embedding generates nothing
    assert affinity_prompt("embeddings", {"input": ["hello there", "x"]}) == "hello there"
    assert affinity_prompt("embeddings", {"input": [5, 6, 7]}) == [5, 6, 7]
    assert estimate_tokens("embeddings", {"input": [[1, 2, 3], [4]]}) == 4
