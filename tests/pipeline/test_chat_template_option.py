"""A model without a chat template (a base model, like the built-in gemma-3-270m) serves
completions and answers chat with 400 naming the missing template, unless --chat-template gives
one (a file or an inline Jinja template)."""
from __future__ import annotations

import asyncio
import copy

import httpx
import pytest

from pagedserve.pipeline.ingress import build_app
from pagedserve.pipeline.ingress.testing import make_test_context, make_tiny_tokenizer
from pagedserve.pipeline.load_error import ModelLoadError
from pagedserve.pipeline.tokenizer import load_tokenizer, read_chat_template

# Gemma 3's turn format: no system role, so a system message is folded into the first user turn.
GEMMA_STYLE = (
    "{{ bos_token }}{% set first = 0 %}{% set prefix = '' %}"
    "{% if messages[0]['role'] == 'system' %}{% set prefix = messages[0]['content'] + '\n\n' %}"
    "{% set first = 1 %}{% endif %}"
    "{% for m in messages[first:] %}{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' "
    "else m['role']) + '\n' + (prefix if loop.first else '') + m['content'] + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")


def _base_model_tokenizer():
    tokenizer = copy.deepcopy(make_tiny_tokenizer())
    tokenizer.chat_template = None
    return tokenizer


def test_chat_without_a_template_is_400_naming_it_and_completions_still_work():
    async def run():
        ctx, engine = make_test_context(_base_model_tokenizer(), max_model_len=256)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(ctx)),
                                     base_url="http://test") as client:
            r = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
            assert r.status_code == 400, r.text
            message = r.json()["error"]["message"]
            assert "no chat template" in message and "--chat-template" in message
            assert engine.submitted == []
            r = await client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 3})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 3
    asyncio.run(run())


def test_chat_template_flag_reads_a_file_or_an_inline_template(tmp_path):
    path = tmp_path / "gemma.jinja"
    path.write_text(GEMMA_STYLE)
    assert read_chat_template(str(path)) == GEMMA_STYLE
    assert read_chat_template(GEMMA_STYLE) == GEMMA_STYLE
    assert read_chat_template(None) is None
    with pytest.raises(ModelLoadError, match="neither a readable file"):
        read_chat_template(str(tmp_path / "missing.jinja"))


def test_a_given_template_replaces_the_tokenizers_own(tmp_path):
    _base_model_tokenizer().save_pretrained(tmp_path)
    assert not load_tokenizer(tmp_path).chat_template
    tokenizer = load_tokenizer(tmp_path, chat_template=GEMMA_STYLE)
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
                    "<start_of_turn>model\n")
