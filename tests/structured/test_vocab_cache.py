"""structured/vocab_cache: the vocabulary's xgrammar tables read back from the cache folder mask
exactly as freshly built ones, and a start that finds them does not load the tokenizer."""
from __future__ import annotations

import json

import pytest

import torch
import xgrammar as xgr

from pagedserve.pipeline.structured.vocab_cache import tokenizer_info

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer", "minimum": 0}},
          "required": ["name", "age"]}


def masks(info, text_so_far: str) -> list[torch.Tensor]:
    """The token masks of SCHEMA's grammar at the start and after each of a few tokens."""
    grammar = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False).compile_json_schema(
        json.dumps(SCHEMA))
    matcher = xgr.GrammarMatcher(grammar)
    out = []
    for ch in text_so_far:
        bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
        matcher.fill_next_token_bitmask(bitmask)
        out.append(bitmask.clone())
        assert matcher.accept_string(ch)
    return out


def test_cached_tables_mask_like_fresh_ones(model_dir, tmp_path):
    from pagedserve.workers.loader import load_config
    config = load_config(model_dir)
    stop = list(config.eos_token_ids)
    fresh = tokenizer_info(str(model_dir), config.vocab_size, stop, None)
    first = tokenizer_info(str(model_dir), config.vocab_size, stop, tmp_path)
    [entry] = (tmp_path / "xgrammar").iterdir()
    cached = tokenizer_info(str(model_dir), config.vocab_size, stop, tmp_path)
    assert (cached.vocab_size, cached.stop_token_ids, cached.vocab_type) == (
        fresh.vocab_size, fresh.stop_token_ids, fresh.vocab_type)
    text = '{"name": "Ada", "age": 36}'
    expected = masks(fresh, text)
    assert all(torch.equal(a, b) for a, b in zip(masks(first, text), expected))
    assert all(torch.equal(a, b) for a, b in zip(masks(cached, text), expected))
    # another stop token list is another entry; a damaged entry is built again
    tokenizer_info(str(model_dir), config.vocab_size, stop + [0], tmp_path)
    assert len(list((tmp_path / "xgrammar").iterdir())) == 2
    entry.write_text("{not json")
    again = tokenizer_info(str(model_dir), config.vocab_size, stop, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(masks(again, text), expected))
    assert json.loads(entry.read_text())  # rewritten whole


def test_a_start_that_finds_the_tables_does_not_load_the_tokenizer(model_dir, tmp_path,
                                                                   monkeypatch):
    from pagedserve.pipeline import tokenizer
    from pagedserve.workers.loader import load_config
    config = load_config(model_dir)
    stop = list(config.eos_token_ids)
    tokenizer_info(str(model_dir), config.vocab_size, stop, tmp_path)

    def refuse(*args, **kwargs):
        raise AssertionError("the tokenizer was loaded")
    monkeypatch.setattr(tokenizer, "load_tokenizer", refuse)
    assert tokenizer_info(str(model_dir), config.vocab_size, stop, tmp_path).vocab_size == \
        config.vocab_size
    with pytest.raises(AssertionError, match="tokenizer was loaded"):
        tokenizer_info(str(model_dir), config.vocab_size, stop + [1], tmp_path)  # not cached
