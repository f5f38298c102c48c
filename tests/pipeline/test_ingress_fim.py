"""Fill-in-the-middle: the prompt built from the tokenizer's FIM tokens (exact ids), `suffix` on
/v1/completions and llama.cpp's /infill over a fake engine, and the 400 for a model without
FIM tokens. The real tokenizers (Qwen2.5-Coder has FIM tokens, SmolLM2 none) when cached."""
import asyncio
import json

import httpx
import pytest

from pagedserve.pipeline.ingress import build_app
from pagedserve.pipeline.ingress.fim import ExtraFile, FimTokens, fim_prompt, fim_tokens
from pagedserve.pipeline.ingress.testing import (make_test_context, make_tiny_tokenizer,
                                                 run_with_client)

QWEN_FIM = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|repo_name|>",
            "<|file_sep|>"]


@pytest.fixture(scope="module")
def fim_tokenizer():
    """The tiny byte tokenizer (one token per byte) with Qwen's FIM tokens, ids 259..263."""
    tok = make_tiny_tokenizer.__wrapped__()
    tok.add_special_tokens({"additional_special_tokens": QWEN_FIM})
    return tok


def run(test, tokenizer=None, **ctx_kwargs):
    run_with_client(test, tokenizer, max_model_len=128, **ctx_kwargs)


def test_fim_tokens_found_in_the_vocabulary_or_none(fim_tokenizer):
    assert fim_tokens(make_tiny_tokenizer()) is None
    assert fim_tokens(fim_tokenizer) == FimTokens(259, 260, 261, repo=262, file_sep=263)


def test_fim_prompt_is_prefix_suffix_middle_with_the_extra_files_first(fim_tokenizer):
    fim = fim_tokens(fim_tokenizer)
    assert fim_prompt(fim_tokenizer, fim, "ab", "c") == [259, *b"ab", 260, *b"c", 261]
    assert fim_prompt(fim_tokenizer, fim, [7, 8], "", middle="x") == [259, 7, 8, 260, 261, *b"x"]
    ids = fim_prompt(fim_tokenizer, fim, "p", "s",
                     extra=[ExtraFile("a.py", "A"), ExtraFile("b.py", "B")])
    assert ids == [262, *b"myproject\n", 263, *b"a.py\n", *b"A", 263, *b"b.py\n", *b"B",
                   263, *b"filename\n", 259, *b"p", 260, *b"s", 261]
    no_files = FimTokens(259, 260, 261)  # CodeLlama's kind: snippets in plain text
    assert fim_prompt(fim_tokenizer, no_files, "p", "", extra=[ExtraFile("a", "A")]) == \
        [*b"\n\n--- snippet ---\n\n", *b"A", 259, *b"p", 260, 261]


def test_completion_suffix_fills_the_middle(fim_tokenizer):
    async def t(client, ctx, engine):
        r = await client.post("/v1/completions", json={"prompt": "def f(", "suffix": "):",
                                                       "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert engine.submitted[-1].prompt_token_ids == [259, *b"def f(", 260, *b"):", 261]
        assert r.json()["usage"]["prompt_tokens"] == 11
        r = await client.post("/v1/completions", json={"prompt": [1, 2], "suffix": "y",
                                                       "max_tokens": 1})
        assert r.status_code == 200, r.text  # token ids: the prefix as they are
        assert engine.submitted[-1].prompt_token_ids == [259, 1, 2, 260, *b"y", 261]
        r = await client.post("/v1/completions", json={"prompt": ["x", "z"], "suffix": "y",
                                                       "max_tokens": 1})
        assert r.status_code == 200, r.text  # a batch: each prompt before the same suffix
        assert [s.prompt_token_ids for s in engine.submitted[-2:]] == [
            [259, *b"x", 260, *b"y", 261], [259, *b"z", 260, *b"y", 261]]
        r = await client.post("/v1/completions", json={"prompt": "x", "suffix": "",
                                                       "max_tokens": 1})
        assert engine.submitted[-1].prompt_token_ids == list(b"x")  # empty: a plain completion
    run(t, fim_tokenizer)


def test_infill_answers_in_llama_cpp_shape(fim_tokenizer):
    async def t(client, ctx, engine):
        body = {"input_prefix": "a", "input_suffix": "b", "prompt": "c", "n_predict": 4,
                "input_extra": [{"filename": "u.py", "text": "U"}]}
        r = await client.post("/infill", json=body)
        assert r.status_code == 200, r.text
        prompt = engine.submitted[-1].prompt_token_ids
        assert prompt == [262, *b"myproject\n", 263, *b"u.py\n", *b"U", 263, *b"filename\n",
                          259, *b"a", 260, *b"b", 261, *b"c"]
        out = r.json()
        assert len(out["content"]) == 4 and out["stop"] is True
        assert out["stop_type"] == "limit" and out["stopping_word"] == ""
        assert out["tokens_predicted"] == 4 and out["tokens_evaluated"] == len(prompt)
        assert out["tokens"] == [] and out["model"] == "tiny" and out["truncated"] is False
        r = await client.post("/infill", json={**body, "max_tokens": 2, "return_tokens": True})
        assert len(r.json()["tokens"]) == 2  # max_tokens wins over n_predict
        r = await client.post("/infill", json={**body, "stream": True})
        events = [json.loads(block[len("data: "):]) for block in r.text.split("\n\n") if block]
        assert "[DONE]" not in r.text  # llama.cpp's own endpoints end without it
        assert [e["stop"] for e in events] == [False] * 4 + [True]
        assert "".join(e["content"] for e in events) == out["content"]
        assert events[-1]["stop_type"] == "limit" and events[-1]["tokens_predicted"] == 4
        assert ctx.admission.in_flight == 0
    run(t, fim_tokenizer)


@pytest.mark.parametrize("body, param, words", [
    ({"input_prefix": "a", "n": 2}, "n", "one completion"),
    ({"input_prefix": "a", "n_predict": 0}, "n_predict", "-1 (up to the context)"),
    ({"input_prefix": "a", "input_extra": [{"text": 5}]}, "input_extra.0.text", "string"),
    ({"input_prefix": "a" * 200}, "input_prefix", "maximum context length"),
])
def test_infill_refusals(fim_tokenizer, body, param, words):
    async def t(client, ctx, engine):
        r = await client.post("/infill", json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param and words in r.json()["error"]["message"]
    run(t, fim_tokenizer)


def test_a_model_without_fim_tokens_is_a_400_naming_the_cause():
    async def t(client, ctx, engine):
        for path, body, param in (("/v1/completions", {"prompt": "a", "suffix": "b"}, "suffix"),
                                  ("/infill", {"input_prefix": "a"}, "input_suffix")):
            r = await client.post(path, json=body)
            assert r.status_code == 400
            error = r.json()["error"]
            assert error["param"] == param and error["code"] == "fim_not_supported"
            assert "no FIM tokens" in error["message"]
        assert engine.submitted == [] and ctx.admission.in_flight == 0
    run(t)


@pytest.mark.slow
def test_real_tokenizers_qwen_coder_has_fim_smollm2_has_none():
    from pagedserve.pipeline.tokenizer import load_tokenizer
    from pagedserve.workers.loader import DEFAULT_MODEL, TEST_MODEL, resolve_model
    try:
        qwen = load_tokenizer(resolve_model(DEFAULT_MODEL))
    except Exception as exc:  # not cached here: the tiny tokenizer's tests cover the layout
        pytest.skip(f"{DEFAULT_MODEL} is not available: {exc}")
    fim = fim_tokens(qwen)
    assert fim is not None and None not in (fim.repo, fim.file_sep)
    ids = fim_prompt(qwen, fim, "def add(a, b):\n    ", "\n\nprint(add(1, 2))",
                     extra=[ExtraFile("util.py", "import os\n")])
    assert qwen.decode(ids) == ("<|repo_name|>myproject\n<|file_sep|>util.py\nimport os\n"
                                "<|file_sep|>filename\n<|fim_prefix|>def add(a, b):\n    "
                                "<|fim_suffix|>\n\nprint(add(1, 2))<|fim_middle|>")
    assert fim_tokens(load_tokenizer(resolve_model(TEST_MODEL))) is None


def test_models_lists_what_the_model_can_do(fim_tokenizer):
    async def capabilities(tokenizer, **settings) -> list[str]:
        ctx, _engine = make_test_context(tokenizer)
        for name, value in settings.items():
            setattr(ctx, name, value)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(ctx)),
                                     base_url="http://test") as client:
            (card,) = (await client.get("/v1/models")).json()["data"]
        return card["capabilities"]
    plain = make_tiny_tokenizer()
    chat = ["chat"] if plain.chat_template else []
    assert asyncio.run(capabilities(plain)) == ["completion", *chat, "json_schema", "embedding"]
    tools = ["chat", "tools"] if fim_tokenizer.chat_template else []
    assert asyncio.run(capabilities(fim_tokenizer, tool_call_parser="hermes",
                                    reasoning_parser="qwen3")) == \
        ["completion", *tools, "insert", "thinking", "json_schema", "embedding"]
    assert asyncio.run(capabilities(plain, is_encoder=True)) == ["embedding"]
