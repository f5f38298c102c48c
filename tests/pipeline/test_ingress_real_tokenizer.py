"""The ingress with SmolLM2's own tokenizer and chat template (needs the model cache)."""
import asyncio

import httpx
import pytest

from pagedserve.pipeline.ingress import build_app
from pagedserve.pipeline.ingress.testing import make_test_context

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from pagedserve.workers.loader import TEST_MODEL, resolve_model
    from pagedserve.pipeline.tokenizer import load_tokenizer
    return load_tokenizer(resolve_model(TEST_MODEL))


def test_chat_template_tokens_and_logprob_bytes(smollm2_tokenizer):
    tok = smollm2_tokenizer

    async def main():
        ctx, engine = make_test_context(tok, max_model_len=2048)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(ctx)),
                                     base_url="http://test") as client:
            r = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "Grüße!"}],
                "max_tokens": 2, "logprobs": True})
            assert r.status_code == 200, r.text
            prompt = engine.submitted[0].prompt_token_ids
            expected = tok.apply_chat_template(
                [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Grüße!"}],
                tokenize=False, add_generation_prompt=True)
            assert tok.decode(prompt) == expected
            assert tok.encode(expected, add_special_tokens=False) == prompt
            r = await client.post("/v1/completions", json={"prompt": "Grüße", "max_tokens": 1})
            assert engine.submitted[-1].prompt_token_ids == tok.encode("Grüße")
    asyncio.run(main())

    # bytes of a token that is only part of a UTF-8 character are the raw bytes, not U+FFFD
    from pagedserve.pipeline.ingress.tokens import TokenText
    text = TokenText(tok)
    ids = tok.encode("ü", add_special_tokens=False)
    assert b"".join(bytes(text.bytes(i)) for i in ids) == "ü".encode()
