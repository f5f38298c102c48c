"""echo with logprobs and prompt_logprobs on /v1/completions against the fake engine: the
legacy completions shape (prompt first, its first token null), max_tokens 0 (the prompt alone,
as lm-evaluation-harness asks), streaming, and vLLM's prompt_logprobs."""
import json

import pytest

from pagedserve.pipeline.ingress.testing import TOY_ALPHABET, make_tiny_tokenizer, run_with_client

HELLO = list(b"Hello")  # the tiny tokenizer has one token per byte

PROMPT_LPS = [-0.1, -0.2, -0.3, -0.4]  # FakeEngine's: -p / 10 for prompt token p


def sse_events(text: str) -> list:
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    return [json.loads(block[len("data: "):]) for block in text.split("\n\n")[:-2]]


def toy_text(prompt_ids, n_tokens):
    """FakeEngine's output for sample 0, no seed."""
    return "".join(TOY_ALPHABET[(sum(prompt_ids) + s) % len(TOY_ALPHABET)]
                   for s in range(n_tokens))


def text_of(token_id):
    return make_tiny_tokenizer().decode([token_id])


def runner_ups(n):
    return {text_of(200 + k): pytest.approx(-0.05 - k) for k in range(n)}


def test_echo_with_logprobs_lists_the_prompt_first():
    async def t(client, ctx, engine):
        r = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3,
                                                       "echo": True, "logprobs": 2})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        out = toy_text(HELLO, 3)
        assert choice["text"] == "Hello" + out
        lp = choice["logprobs"]
        assert lp["tokens"] == list("Hello") + list(out)
        assert lp["token_logprobs"][0] is None
        assert lp["token_logprobs"][1:] == pytest.approx(PROMPT_LPS + [-0.5] * 3)
        assert lp["text_offset"] == list(range(8))
        assert lp["top_logprobs"][0] is None
        for pos, ch in enumerate("ello", 1):
            assert lp["top_logprobs"][pos] == runner_ups(2) | {ch: pytest.approx(-pos / 10)}
        assert len(lp["top_logprobs"][5]) == 2  # the output's: sampled token + 1 runner-up
        assert engine.submitted[0].params.prompt_logprobs == 2
    run_with_client(t)


def test_max_tokens_0_with_echo_gives_the_prompt_alone():
    async def t(client, ctx, engine):
        r = await client.post("/v1/completions", json={
            "prompt": [HELLO, list(b"Hi")], "max_tokens": 0, "echo": True, "logprobs": 1,
            "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        first, second = body["choices"]
        assert first["text"] == "Hello" and second["text"] == "Hi"
        assert first["logprobs"]["tokens"] == list("Hello")
        assert first["logprobs"]["token_logprobs"][0] is None
        assert first["logprobs"]["token_logprobs"][1:] == pytest.approx(PROMPT_LPS)
        assert second["logprobs"]["token_logprobs"][0] is None
        assert second["logprobs"]["token_logprobs"][1:] == pytest.approx([-0.1])
        assert first["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == 7
        assert [s.params.max_tokens for s in engine.submitted] == [1, 1]  # one, dropped
    run_with_client(t)


def test_streamed_echo_carries_the_prompt_logprobs_in_the_first_chunk():
    async def t(client, ctx, engine):
        r = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2,
                                                       "echo": True, "logprobs": 0,
                                                       "stream": True})
        chunks = [c["choices"][0] for c in sse_events(r.text)]
        assert [c["text"] for c in chunks] == ["Hello" + toy_text(HELLO, 1),
                                               toy_text(HELLO, 2)[1]]
        first, second = chunks[0]["logprobs"], chunks[1]["logprobs"]
        assert first["token_logprobs"][0] is None
        assert first["token_logprobs"][1:] == pytest.approx(PROMPT_LPS + [-0.5])
        assert first["text_offset"] == list(range(6)) and second["text_offset"] == [6]
        r = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 0,
                                                       "echo": True, "logprobs": 0,
                                                       "stream": True})
        (only,) = [c["choices"][0] for c in sse_events(r.text)]
        assert only["text"] == "Hello" and only["finish_reason"] == "length"
        assert only["logprobs"]["tokens"] == list("Hello")
    run_with_client(t)


@pytest.mark.parametrize("stream", [False, True])
def test_vllm_prompt_logprobs_field(stream):
    async def t(client, ctx, engine):
        r = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1,
                                                       "prompt_logprobs": 1, "stream": stream})
        assert r.status_code == 200, r.text
        choice = sse_events(r.text)[0]["choices"][0] if stream else r.json()["choices"][0]
        assert choice["text"] == toy_text(HELLO, 1) and choice["logprobs"] is None
        plp = choice["prompt_logprobs"]
        assert plp[0] is None and len(plp) == 5
        assert plp[2] == {"200": {"logprob": pytest.approx(-0.05), "decoded_token": text_of(200)},
                          str(ord("l")): {"logprob": pytest.approx(-0.2), "decoded_token": "l"}}
    run_with_client(t)


def test_prompt_logprobs_lost_on_the_way_are_a_503():
    """A detokenizer restart re-feeds tokens but no prompt logprobs: the answer says so."""
    async def t(client, ctx, engine):
        engine.drop_prompt_logprobs = True
        for asked in ({"echo": True, "logprobs": 1}, {"prompt_logprobs": 0}):
            r = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1,
                                                           **asked})
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "prompt_logprobs_lost"
    run_with_client(t)
