"""Property: each built-in's tokenizer (rebuilt from its GGUF by the conversion) encodes 1,000
ShareGPT turns, CJK and emoji among them, to exactly llama.cpp's ids, and decodes llama.cpp's ids
to exactly llama.cpp's text (scripts/tokenizer_reference.py; llama-server on 127.0.0.1)."""
from __future__ import annotations

import pytest

from script_module import load_script

pytestmark = pytest.mark.slow

NUM_TEXTS = 1000


@pytest.fixture(scope="module")
def reference():
    module = load_script("tokenizer_reference")
    if module.llama_server_binary() is None:
        pytest.skip("no llama-server cached under $PAGEDSERVE_CACHE/llama.cpp/ (build it with "
                    "scripts/compare_llama_server.py --build-only): no reference to compare with")
    return module


@pytest.fixture(scope="module")
def texts(reference):
    found = reference.sharegpt_texts(NUM_TEXTS)
    assert len(found) == NUM_TEXTS
    assert sum(bool(reference._CJK.search(t)) for t in found) >= 50
    assert sum(bool(reference._EMOJI.search(t)) for t in found) >= 50
    return found


@pytest.mark.parametrize("name", ["SmolLM2-135M-Instruct", "Qwen2.5-Coder-0.5B-Instruct",
                                  "gemma-3-270m"])
def test_encode_and_decode_equal_llama_cpp(reference, texts, name):
    from pagedserve.pipeline.tokenizer import load_tokenizer
    from pagedserve.workers.builtin_models import builtin_gguf
    from pagedserve.workers.gguf_files import gguf_tokenizer
    from pagedserve.workers.loader import _is_complete, default_cache_dir

    cache = default_cache_dir()
    gguf = builtin_gguf(name, cache)
    converted = cache / "models" / name
    # the served tokenizer when the model is converted; else the same one, built alone (a
    # minute, where converting the weights too would take several)
    tokenizer = load_tokenizer(converted) if _is_complete(converted) else gguf_tokenizer(gguf)
    with reference.LlamaServer(reference.llama_server_binary(), gguf) as server:
        result = reference.compare(tokenizer, server, texts)
    assert result.encode_equal == result.decode_equal == NUM_TEXTS, result.summary()
