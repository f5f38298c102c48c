"""detokenizer/decoder: the decoding tokenizer read back from the cache decodes every id sequence
as the transformers tokenizer does and drops the same special ids; a start that finds it never
imports transformers."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from pagedserve.pipeline.detokenizer.decoder import DecodeOnlyTokenizer, load_decoder
from pagedserve.pipeline.detokenizer.incremental import special_token_ids
from pagedserve.workers.loader import resolve_model


@pytest.mark.parametrize("name", ["SmolLM2-135M-Instruct", "Qwen2.5-Coder-0.5B-Instruct",
                                  "gemma-3-270m"])
def test_a_cached_decoder_decodes_as_transformers(name, tmp_path):
    model_dir = resolve_model(name)
    full = load_decoder(model_dir, tmp_path)       # loads whole, stores its decoder
    assert full.__class__ is not DecodeOnlyTokenizer
    [entry] = (tmp_path / "decoders").iterdir()
    cached = load_decoder(model_dir, tmp_path)
    assert isinstance(cached, DecodeOnlyTokenizer)
    assert special_token_ids(cached) == special_token_ids(full) != frozenset()
    rng = np.random.default_rng(0)
    special = sorted(special_token_ids(full))
    text = "Hello, wörld! 🤖 def f(x):\n\treturn x  # ünïcödé 日本語"
    sequences = [full.encode(text), special[:4] + full.encode(text) + special[-2:]]
    sequences += [rng.integers(0, len(full), n).tolist() for n in (1, 7, 64)]
    for ids in sequences:
        for skip in (True, False):
            assert cached.decode(ids, skip_special_tokens=skip) == full.decode(
                ids, skip_special_tokens=skip), (ids, skip)
    if name != "SmolLM2-135M-Instruct":
        return                # the damaged entry once: a whole load of Gemma's takes ~5 s
    entry.write_text("{}")  # damaged: loaded whole again and rewritten
    assert load_decoder(model_dir, tmp_path).__class__ is full.__class__
    assert isinstance(load_decoder(model_dir, tmp_path), DecodeOnlyTokenizer)
    assert "special_ids" in json.loads(entry.read_text())


def test_a_detokenizer_start_that_finds_the_decoder_does_not_import_transformers(tmp_path):
    model_dir = resolve_model("SmolLM2-135M-Instruct")
    load_decoder(model_dir, tmp_path)
    code = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from pagedserve.pipeline.detokenizer.decoder import load_decoder
        tokenizer = load_decoder({str(model_dir)!r}, Path({str(tmp_path)!r}))
        print(type(tokenizer).__name__, "transformers" in sys.modules, "torch" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["DecodeOnlyTokenizer", "False", "False"]
