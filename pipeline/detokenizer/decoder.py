"""What the detokenizer needs of a tokenizer, loaded without transformers after the first time.

The detokenizer only decodes: through the fast tokenizer's Rust backend (`tokenizers`), dropping
the ids `skip_special_tokens` drops. Loading the transformers tokenizer to get those costs
seconds of every start (transformers imports torch); so the first load stores the backend as
transformers finished it (its JSON) and the special ids in `<cache>/decoders/`, keyed by the
tokenizer's files and the transformers version, and later starts read them back. A tokenizer
whose decode is more than its backend's (space clean-up) is always loaded whole.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from pagedserve.cache_files import (TOKENIZER_FILES, cache_key, package_version, read_cached,
                                   write_text_atomic)
from pagedserve.pipeline.detokenizer.incremental import special_token_ids

log = logging.getLogger(__name__)


@dataclass
class DecodeOnlyTokenizer:
    """The decoding part of a fast tokenizer: `decode` as transformers' (without clean-up)."""
    backend_tokenizer: object          # tokenizers.Tokenizer
    all_special_ids: list[int]
    clean_up_tokenization_spaces: bool = False
    added_tokens_decoder: dict = field(default_factory=dict)  # folded into all_special_ids

    def decode(self, token_ids, skip_special_tokens: bool = False, **_unused) -> str:
        return self.backend_tokenizer.decode(list(token_ids),
                                             skip_special_tokens=skip_special_tokens)


def load_decoder(tokenizer_dir: str | Path, cache_root: Path | None):
    """A DecodeOnlyTokenizer from the cache, else the full tokenizer (caching its decoder)."""
    from pagedserve.pipeline.tokenizer import load_tokenizer
    path = _entry(Path(tokenizer_dir), cache_root) if cache_root is not None else None
    cached = read_cached(path, _parse, log) if path is not None else None
    if cached is not None:
        return cached
    tokenizer = load_tokenizer(tokenizer_dir)
    if path is not None and not tokenizer.clean_up_tokenization_spaces:
        entry = {"backend": tokenizer.backend_tokenizer.to_str(),
                 "special_ids": sorted(special_token_ids(tokenizer))}
        write_text_atomic(path, json.dumps(entry), log)
    return tokenizer


def _parse(text: str) -> DecodeOnlyTokenizer:
    from tokenizers import Tokenizer
    entry = json.loads(text)
    return DecodeOnlyTokenizer(Tokenizer.from_str(entry["backend"]),
                               [int(i) for i in entry["special_ids"]])


def _entry(tokenizer_dir: Path, cache_root: Path) -> Path:
    key = cache_key(package_version("transformers"),
                    files=(tokenizer_dir / name for name in TOKENIZER_FILES))
    return Path(cache_root) / "decoders" / f"{key}.json"
