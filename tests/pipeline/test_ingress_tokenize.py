"""/tokenize and /detokenize (vLLM's shapes) against a fake engine: the counts a generation
request would use, the chat template, token strings, the key, and every refusal a 400."""
import pytest

from pagedserve.pipeline.ingress.testing import make_test_context, run_with_client

MSGS = [{"role": "user", "content": "hi"}]


run = run_with_client


def test_tokenize_a_prompt_counts_what_a_completion_would_submit():
    async def t(client, ctx, engine):
        r = await client.post("/tokenize", json={"model": "tiny", "prompt": "Hello"})
        assert r.status_code == 200, r.text
        assert r.json() == {"count": 5, "max_model_len": 64, "tokens": list(b"Hello")}
        await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1})
        assert engine.submitted[-1].prompt_token_ids == r.json()["tokens"]
        r = await client.post("/tokenize", json={"prompt": "a b", "return_token_strs": True})
        assert r.json()["token_strs"] == ["a", "Ġ", "b"]  # the tokenizer's own spelling
        assert (await client.post("/tokenize", json={"prompt": ""})).json()["count"] == 0
        assert engine.submitted[-1].prompt_token_ids == list(b"Hello")  # nothing generated
    run(t)


def test_tokenize_messages_through_the_chat_template():
    async def t(client, ctx, engine):
        r = await client.post("/tokenize", json={"messages": MSGS})
        assert r.status_code == 200, r.text
        await client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1})
        assert r.json()["tokens"] == engine.submitted[-1].prompt_token_ids
        assert r.json()["count"] == len(r.json()["tokens"])
        text = ctx.tokenizer.decode(r.json()["tokens"])
        assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        r = await client.post("/tokenize", json={"messages": MSGS, "add_generation_prompt": False})
        assert ctx.tokenizer.decode(r.json()["tokens"]) == "<|im_start|>user\nhi<|im_end|>\n"
    run(t)


@pytest.mark.parametrize("body, param, words", [
    ({}, "prompt", "'prompt' is a required field"),
    ({"prompt": 5}, "prompt", "prompt"),
    ({"prompt": "x", "messages": MSGS}, "messages", "not both"),
    ({"messages": []}, "messages", "at least 1"),
    ({"messages": MSGS, "add_generation_prompt": True, "continue_final_message": True},
     "continue_final_message", "cannot both be true"),
    ({"messages": MSGS, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs",
     "may not set tokenize"),
    ({"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools",
     "does not render tools"),
    ({"messages": MSGS, "tools": [{"type": "nope"}]}, "tools", "tools[0] must be"),
])
def test_tokenize_refusals_are_400_naming_the_field(body, param, words):
    async def t(client, ctx, engine):
        r = await client.post("/tokenize", json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and words in error["message"], error
        assert error["type"] == "invalid_request_error"
    run(t)


def test_detokenize_round_trip_and_out_of_vocabulary_ids():
    async def t(client, ctx, engine):
        r = await client.post("/detokenize", json={"model": "tiny", "tokens": list(b"Gr\xc3\xbc")})
        assert r.status_code == 200 and r.json() == {"prompt": "Grü"}
        assert (await client.post("/detokenize", json={"tokens": []})).json() == {"prompt": ""}
        for bad in ([1, 259], [-1]):
            r = await client.post("/detokenize", json={"tokens": bad})
            assert r.status_code == 400
            assert r.json()["error"]["param"] == "tokens"
            assert f"token id {bad[-1]}, outside the vocabulary [0, 259)" in \
                r.json()["error"]["message"]
        r = await client.post("/detokenize", json={"tokens": "abc"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
        r = await client.post("/detokenize", json={"model": "other", "tokens": [1]})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    run(t)


def test_token_routes_need_the_api_key_and_bound_the_body():
    async def t(client, ctx, engine):
        for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
            assert (await client.post(path, json=body)).status_code == 401
            r = await client.post(path, json=body, headers={"Authorization": "Bearer k"})
            assert r.status_code == 200
        r = await client.post("/tokenize", json={"prompt": "x" * 5000},
                              headers={"Authorization": "Bearer k"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        r = await client.post("/tokenize", content=b"{", headers={"Authorization": "Bearer k"})
        assert r.status_code == 400
    run(t, api_key="k", max_request_bytes=4096)


def test_counting_is_linear_in_the_input():
    """4x the text (a prompt, and as many messages) takes about 4x the time, far from 16x."""
    import time

    from pagedserve.pipeline.ingress.tokenize import tokenize_body
    ctx, _ = make_test_context(max_model_len=1 << 20)

    def seconds(body):
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            out = tokenize_body(ctx, body)
            best = min(best, time.perf_counter() - start)
        return best, out["count"]

    for make in (lambda n: {"prompt": "ab c{" * n, "return_token_strs": True},
                 lambda n: {"messages": [{"role": "user", "content": "ab c{"}] * (n // 50)}):
        (small, n_small), (large, n_large) = seconds(make(4_000)), seconds(make(16_000))
        assert n_large >= 4 * n_small - 4 * 30  # the template's fixed tokens
        assert large < 10 * small + 0.02, (small, large)
