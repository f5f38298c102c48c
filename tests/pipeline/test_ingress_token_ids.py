"""`return_token_ids` (vLLM's extension): every choice carries its token ids and the prompt's,
streamed and not; the router resumes a broken stream from them."""

from test_ingress_api import HELLO, MSGS, run_with_client, sse_events


def test_completion_stream_and_body_carry_token_ids():
    async def t(client, ctx, engine):
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 5, "return_token_ids": True}
        r = await client.post("/v1/completions", json=body)
        [choice] = r.json()["choices"]
        assert choice["prompt_token_ids"] == HELLO and len(choice["token_ids"]) == 5
        assert ctx.tokenizer.decode(choice["token_ids"]) == choice["text"]
        events = sse_events((await client.post("/v1/completions",
                                               json={**body, "stream": True})).text)
        assert events[0]["choices"][0]["prompt_token_ids"] == HELLO
        assert all("prompt_token_ids" not in e["choices"][0] for e in events[1:])
        assert sum((e["choices"][0]["token_ids"] for e in events), []) == choice["token_ids"]
        plain = (await client.post("/v1/completions", json={**body, "return_token_ids": None}))
        assert "token_ids" not in plain.json()["choices"][0]
    run_with_client(t)


def test_chat_stream_carries_token_ids():
    async def t(client, ctx, engine):
        body = {"model": "tiny", "messages": MSGS, "max_tokens": 4, "return_token_ids": True}
        whole = (await client.post("/v1/chat/completions", json=body)).json()
        prompt = engine.submitted[0].prompt_token_ids
        assert whole["prompt_token_ids"] == prompt and len(whole["choices"][0]["token_ids"]) == 4
        events = sse_events((await client.post("/v1/chat/completions",
                                               json={**body, "stream": True})).text)
        assert events[0]["prompt_token_ids"] == prompt
        streamed = sum((e["choices"][0].get("token_ids", []) for e in events), [])
        assert streamed == whole["choices"][0]["token_ids"]
    run_with_client(t)
