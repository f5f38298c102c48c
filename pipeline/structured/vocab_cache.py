"""xgrammar's view of a vocabulary (`TokenizerInfo`), kept on disk between starts.

Building it needs the transformers tokenizer (importing transformers costs seconds, and it
imports torch) and a pass over every token; reading it back from its JSON takes a fraction of a
second. Entries live in `<cache>/xgrammar/`, keyed by the tokenizer's files, the vocabulary size,
the stop tokens and the xgrammar version; a missing or unreadable entry is built again.
"""
from __future__ import annotations

import logging
from pathlib import Path

from pagedserve.cache_files import (TOKENIZER_FILES, cache_key, package_version, read_cached,
                                   write_text_atomic)

log = logging.getLogger(__name__)


def tokenizer_info(tokenizer_dir: str, vocab_size: int, stop_token_ids: list[int],
                   cache_root: Path | None):
    """The vocabulary's TokenizerInfo, from the cache when it holds one."""
    import xgrammar as xgr
    path = _entry(tokenizer_dir, vocab_size, stop_token_ids, cache_root) if cache_root else None
    cached = read_cached(path, xgr.TokenizerInfo.deserialize_json, log,
                         (OSError, ValueError, RuntimeError)) if path is not None else None
    if cached is not None:
        return cached
    from pagedserve.pipeline.tokenizer import load_tokenizer
    info = xgr.TokenizerInfo.from_huggingface(load_tokenizer(tokenizer_dir), vocab_size=vocab_size,
                                              stop_token_ids=stop_token_ids)
    if path is not None:
        write_text_atomic(path, info.serialize_json(), log)
    return info


def _entry(tokenizer_dir: str, vocab_size: int, stop_token_ids: list[int],
           cache_root: Path) -> Path:
    key = cache_key(package_version("xgrammar"), str(vocab_size), str(sorted(stop_token_ids)),
                    files=(Path(tokenizer_dir) / name for name in TOKENIZER_FILES))
    return Path(cache_root) / "xgrammar" / f"{key}.json"
