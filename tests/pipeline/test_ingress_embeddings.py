"""POST /v1/embeddings over a fake engine: OpenAI's shapes of input and output, dimensions,
base64, usage, and a 400 naming the cause for every bad body."""
from __future__ import annotations

import base64

import numpy as np
import pytest

from pagedserve.pipeline.ingress.testing import (FAKE_HIDDEN_SIZE, fake_embedding,
                                                 make_tiny_tokenizer, run_with_client)


def ids_of(text):
    return make_tiny_tokenizer().encode(text)


def test_every_input_shape_gets_its_vector_in_order():
    async def test(client, ctx, engine):
        cases = [("hello", ["hello"]), (["ab", "cde"], ["ab", "cde"]),
                 ([5, 6, 7], [[5, 6, 7]]), ([[1, 2], [3]], [[1, 2], [3]])]
        for given, items in cases:
            r = await client.post("/v1/embeddings", json={"model": "tiny", "input": given})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["object"] == "list" and body["model"] == "tiny"
            ids = [ids_of(x) if isinstance(x, str) else x for x in items]
            assert [d["index"] for d in body["data"]] == list(range(len(items)))
            for d, prompt in zip(body["data"], ids):
                assert d["object"] == "embedding"
                assert np.allclose(d["embedding"], fake_embedding(prompt), atol=1e-7)
            count = sum(map(len, ids))
            assert body["usage"] == {"prompt_tokens": count, "total_tokens": count}
        assert all(s.pooling is not None for s in engine.submitted)
    run_with_client(test)


def test_dimensions_truncate_and_normalize_and_base64_is_little_endian_float32():
    async def test(client, ctx, engine):
        r = await client.post("/v1/embeddings", json={"input": "hey", "dimensions": 3})
        got = np.array(r.json()["data"][0]["embedding"])
        full = np.array(fake_embedding(ids_of("hey")))
        assert np.allclose(got, full[:3] / np.linalg.norm(full[:3]), atol=1e-6)
        r = await client.post("/v1/embeddings", json={"input": "hey",
                                                     "encoding_format": "base64"})
        raw = base64.b64decode(r.json()["data"][0]["embedding"])
        assert np.allclose(np.frombuffer(raw, "<f4"), full, atol=1e-7)
    run_with_client(test)


@pytest.mark.parametrize("body, status, message", [
    ({"input": "x", "dimensions": 0}, 400, f"dimensions must be an integer from 1 to the "
                                          f"model's hidden size {FAKE_HIDDEN_SIZE}, got 0"),
    ({"input": "x", "dimensions": FAKE_HIDDEN_SIZE + 1}, 400, "hidden size"),
    ({"input": ""}, 400, "input[0] is empty"),
    ({"input": []}, 400, "input"),
    ({"input": ["a", ""]}, 400, "input[1] is empty"),
    ({"input": "y" * 65}, 400, "input[0] has 65 tokens but the model takes at most 64"),
    ({"input": [[1], [10**6]]}, 400, "outside the vocabulary"),
    ({"input": ["a"] * 9}, 400, "batch of 9 inputs, but at most 8"),
    ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": 5}, 400, "input"),
    ({}, 400, "'input' is a required field"),
    ({"input": "x", "priority": 2**70}, 400, "priority"),
    ({"input": "x", "model": "other"}, 404, "does not exist"),
])
def test_bad_bodies_are_refused_naming_the_cause(body, status, message):
    async def test(client, ctx, engine):
        r = await client.post("/v1/embeddings", json=body)
        assert r.status_code == status, r.text
        assert message in r.json()["error"]["message"]
        assert not engine.submitted  # refused before anything reached the engine
    run_with_client(test)
