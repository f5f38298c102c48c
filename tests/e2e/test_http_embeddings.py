"""/v1/embeddings through the openai SDK over launched groups: all-MiniLM-L6-v2 (the BERT
built-in) against transformers with sentence-transformers' pooling (its modules.json: mean,
then normalize), every SDK encoding, dimensions and the 400s; and a decoder (the tests' model)
whose greedy generations are the same with embedding requests batched in."""
from __future__ import annotations

import asyncio

import httpx
import numpy as np
import openai
import pytest
import torch

from pagedserve.pipeline.tokenizer import load_tokenizer
from pagedserve.workers.loader import TEST_MODEL, resolve_model
from faults.conftest import Group

pytestmark = pytest.mark.slow

MINILM = "all-MiniLM-L6-v2"
TEXTS = ["A man is eating food.", "Paged attention keeps the KV cache in fixed-size blocks.",
         "The quick brown fox jumps over the lazy dog " * 8, "hi"]


def sentence_transformers_reference(model_dir, texts):
    """What SentenceTransformer(model_dir).encode(texts) computes for this model: BERT's last
    hidden states, mean over the tokens, L2-normalized (modules.json: Transformer, Pooling
    with pooling_mode_mean_tokens, Normalize; max_seq_length 256 is not reached here)."""
    from transformers import AutoModel, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for text in texts:
        ids = tokenizer(text, return_tensors="pt")
        assert ids["input_ids"].shape[1] <= 256
        with torch.no_grad():
            hidden = model(**ids).last_hidden_state[0]
        out.append(torch.nn.functional.normalize(hidden.mean(0), dim=-1).numpy())
    return np.stack(out)


@pytest.fixture(scope="module")
def minilm():
    model_dir = resolve_model(MINILM)
    group = Group(model_dir, http=True, extra=("--served-model-name", MINILM))
    sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{group.port}/v1", api_key="none",
                        max_retries=0, timeout=120)
    yield group, sdk, model_dir
    group.close()


def test_minilm_matches_sentence_transformers_pooling(minilm):
    group, sdk, model_dir = minilm
    want = sentence_transformers_reference(model_dir, TEXTS)
    default = sdk.embeddings.create(model=MINILM, input=TEXTS)  # the SDK asks for base64
    floats = sdk.embeddings.create(model=MINILM, input=TEXTS, encoding_format="float")
    for response in (default, floats):
        got = np.array([d.embedding for d in response.data])
        assert got.shape == (4, 384)
        cosine = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
        assert cosine.min() >= 0.9999, cosine
        assert np.abs(got - want).max() < 1e-4
    tokenizer = load_tokenizer(model_dir)
    count = sum(len(tokenizer.encode(t)) for t in TEXTS)
    assert default.usage.prompt_tokens == default.usage.total_tokens == count
    short = sdk.embeddings.create(model=MINILM, input=TEXTS[0], dimensions=64)
    head = want[0][:64] / np.linalg.norm(want[0][:64])
    assert np.allclose(short.data[0].embedding, head, atol=1e-4)
    ids = sdk.embeddings.create(model=MINILM, input=[tokenizer.encode(TEXTS[1])])
    assert np.allclose(ids.data[0].embedding, want[1], atol=1e-4)


def test_minilm_refuses_what_it_cannot_do(minilm):
    group, sdk, _ = minilm
    with pytest.raises(openai.BadRequestError, match="has 602 tokens but the model takes at "
                                                     "most 512"):
        sdk.embeddings.create(model=MINILM, input="word " * 600)
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        sdk.embeddings.create(model=MINILM, input="x", dimensions=385)
    with pytest.raises(openai.BadRequestError, match="encoder: it serves embeddings"):
        sdk.completions.create(model=MINILM, prompt="hello", max_tokens=2)
    models = httpx.get(f"http://127.0.0.1:{group.port}/v1/models").json()["data"]
    assert models[0]["capabilities"] == ["embedding"]


def test_decoder_generations_are_unchanged_by_embeddings_in_the_batch():
    model_dir = resolve_model(TEST_MODEL)
    group = Group(model_dir, http=True, extra=("--max-model-len", "1024"))
    try:
        url = f"http://127.0.0.1:{group.port}/v1"
        prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
        docs = [f"Document {i}: " + "embeddings share the step with decodes. " * (i + 1)
                for i in range(12)]

        async def run(with_embeddings: bool):
            client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=300)
            gens = [client.completions.create(model=TEST_MODEL, prompt=p, max_tokens=24,
                                              temperature=0, extra_body={"ignore_eos": True})
                    for p in prompts]
            embeds = [client.embeddings.create(model=TEST_MODEL, input=d,
                                               encoding_format="float")
                      for d in docs] if with_embeddings else []
            done = await asyncio.gather(*gens, *embeds)
            await client.close()
            return ([c.choices[0].text for c in done[:len(prompts)]],
                    [np.array(e.data[0].embedding) for e in done[len(prompts):]])
        alone, _ = asyncio.run(run(False))
        mixed, vectors = asyncio.run(run(True))
        assert mixed == alone
        assert all(abs(np.linalg.norm(v) - 1) < 1e-5 for v in vectors)
        again = openai.OpenAI(base_url=url, api_key="none").embeddings.create(
            model=TEST_MODEL, input=docs[3], encoding_format="float")
        assert np.allclose(again.data[0].embedding, vectors[3], atol=1e-5)  # batch-independent
        stats = group.client.stats()
        assert stats["num_unfinished_requests"] == 0
        assert stats["kv_blocks_used"] == 0  # no embedding request kept its blocks
    finally:
        group.close()


def test_offline_llm_embed_in_process():
    """vLLM's `LLM.embed` on the same scheduler, worker and detokenizer in this process."""
    from pagedserve import LLM
    model_dir = resolve_model(MINILM)
    llm = LLM(model=str(model_dir), in_process=True, dtype="float32", kv_cache_memory="32MiB")
    try:
        outs = llm.embed(TEXTS)
    finally:
        llm.close()
    want = sentence_transformers_reference(model_dir, TEXTS)
    assert np.abs(np.array([o.outputs.embedding for o in outs]) - want).max() < 1e-4
    assert [len(o.prompt_token_ids) for o in outs] == \
        [len(load_tokenizer(model_dir).encode(t)) for t in TEXTS]
