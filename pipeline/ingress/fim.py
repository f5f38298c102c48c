"""Fill-in-the-middle prompts: `suffix` on /v1/completions and llama.cpp's /infill.

A code model trained for FIM reads `<prefix token> prefix <suffix token> suffix <middle token>`
and writes the middle. The tokens come from the tokenizer's vocabulary, in one of the known
spellings (`FIM_STYLES`); repository-level context (llama.cpp's `input_extra`) goes before it
as `<repo token>myproject\\n` and one `<file-separator token>filename\\n text` per file, as
llama.cpp lays it out. A model whose vocabulary has no FIM tokens is a 400 naming the cause.
Every piece is encoded once: the cost is linear in the request's text.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from pagedserve.pipeline.ingress.errors import invalid


@dataclass(frozen=True, slots=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int
    repo: int | None = None      # the repository-name token, before the extra files
    file_sep: int | None = None  # the token that opens each file of context

    def special_ids(self) -> list[int]:
        return [t for t in (self.prefix, self.suffix, self.middle, self.repo, self.file_sep)
                if t is not None]


# (prefix, suffix, middle, repo, file separator) as each family spells them.
FIM_STYLES = (
    # Qwen2.5-Coder
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|repo_name|>", "<|file_sep|>"),
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<reponame>", "<file_sep>"),  # StarCoder
    ("<fim-prefix>", "<fim-suffix>", "<fim-middle>", None, None),  # SantaCoder
    ("▁<PRE>", "▁<SUF>", "▁<MID>", None, None),  # CodeLlama
    ("<PRE>", "<SUF>", "<MID>", None, None),
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", None, None),  # DeepSeek-Coder
)
DEFAULT_REPO_NAME = "myproject"  # llama.cpp's placeholders for what /infill does not name
DEFAULT_FILENAME = "filename"


def _token_id(tokenizer: Any, token: str | None) -> int | None:
    if token is None:
        return None
    found = tokenizer.convert_tokens_to_ids(token)
    if found is None or found == tokenizer.unk_token_id:
        return None
    return found


@functools.lru_cache(maxsize=8)  # per tokenizer object: the served one, and tests' few
def fim_tokens(tokenizer: Any) -> FimTokens | None:
    """The tokenizer's FIM tokens, or None when its vocabulary has none."""
    for style in FIM_STYLES:
        ids = [_token_id(tokenizer, token) for token in style]
        if None not in ids[:3]:
            return FimTokens(*ids)
    return None


def require_fim(tokenizer: Any, param: str) -> FimTokens:
    found = fim_tokens(tokenizer)
    if found is None:
        raise invalid(f"{param} needs fill-in-the-middle, but this model's tokenizer has no FIM "
                      "tokens (<|fim_prefix|>, <|fim_suffix|>, <|fim_middle|> or another "
                      "family's spelling): serve a code model trained for it, such as "
                      "Qwen2.5-Coder", param, code="fim_not_supported")
    return found


def _leading_bos(tokenizer: Any) -> list[int]:
    """[BOS] when the tokenizer starts every text with it (Llama's do, Qwen's do not)."""
    bos = tokenizer.bos_token_id
    added = tokenizer.encode("", add_special_tokens=True)
    return [bos] if bos is not None and added[:1] == [bos] else []


@dataclass(frozen=True, slots=True)
class ExtraFile:
    filename: str
    text: str


def fim_prompt(tokenizer: Any, fim: FimTokens, prefix: str | list[int], suffix: str, *,
               middle: str = "", extra: list[ExtraFile] = ()) -> list[int]:
    """The token ids of a FIM prompt (prefix-suffix-middle order): the extra files' context,
    the prefix (text, or token ids taken as they are), the suffix, then `middle`, the start of
    the answer the model continues (llama.cpp's `prompt`)."""
    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False) if text else []

    ids: list[int] = _leading_bos(tokenizer)
    if extra and fim.repo is not None:
        ids += [fim.repo, *encode(DEFAULT_REPO_NAME + "\n")]
    for item in extra:
        if fim.file_sep is not None:
            ids += [fim.file_sep, *encode(item.filename + "\n")]
        else:  # no file token: llama.cpp's plain-text separator between snippets
            ids += encode("\n\n--- snippet ---\n\n")
        ids += encode(item.text)
    if extra and fim.file_sep is not None:  # the file being edited
        ids += [fim.file_sep, *encode(DEFAULT_FILENAME + "\n")]
    ids.append(fim.prefix)
    ids += list(prefix) if isinstance(prefix, list) else encode(prefix)
    ids.append(fim.suffix)
    ids += encode(suffix)
    ids.append(fim.middle)
    ids += encode(middle)
    return ids
