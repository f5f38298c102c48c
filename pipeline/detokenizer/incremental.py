"""Incremental detokenization of one sequence: token ids in, newly stable text out.

Decoding each new token on its own is wrong in two ways: a multi-byte UTF-8 character may be
split across byte-level tokens (decoding a part gives U+FFFD), and a tokenizer's decoder may
render a token differently depending on its neighbours (SentencePiece drops the leading space of
the first token it sees). So we decode a small window: `prefix` tokens already emitted, whose text
we subtract, followed by the tokens not yet emitted. Text that ends in U+FFFD may still become a
character and is held back until a later token completes it or `flush()` ends the sequence.
The window only spans the tokens since the last stable point, so the cost of a token does not
grow with the length of the output.
"""
from __future__ import annotations

from typing import Iterable, Protocol, Sequence

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded ahead of the output, so the output's first token is rendered as it is in
# the full sequence (e.g. keeps the space SentencePiece would strip from a leading "▁word").
PROMPT_CONTEXT_TOKENS = 5
MAX_CONTEXT_TOKENS = 12
# Held tokens after which we look for an earlier token boundary that is safe to emit through.
# A real character needs at most 4 byte tokens; more means the model is producing invalid UTF-8.
MAX_HELD_TOKENS = 8
MAX_HELD_INVALID = 4 * MAX_HELD_TOKENS
# Drop emitted ids from the front of the window once this many have piled up (amortised O(1)).
_TRIM_AT = 64


class Tokenizer(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ..., **kwargs) -> str: ...


def special_token_ids(tokenizer) -> frozenset[int]:
    """Ids that `decode(..., skip_special_tokens=True)` drops: the named special tokens plus
    added tokens flagged special (chat markers such as <|im_start|> are often only the latter)."""
    ids = set(getattr(tokenizer, "all_special_ids", ()))
    for token_id, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(added, "special", False):
            ids.add(token_id)
    return frozenset(ids)


class IncrementalDetokenizer:
    """Emits text such that everything `add` and `flush` returned concatenates to the decode of
    all output ids (in the context of the prompt's last tokens)."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True,
                 *, special_ids: Iterable[int] | None = None):
        """`special_ids` defaults to `special_token_ids(tokenizer)`; pass it to share one set."""
        self._tokenizer = tokenizer
        # Fast tokenizers ignore spaces_between_special_tokens; slow ones honour it.
        self._decode_kwargs = {"skip_special_tokens": skip_special_tokens,
                               "spaces_between_special_tokens": spaces_between_special_tokens}
        # A fast tokenizer's decode is its Rust backend's plus optional space clean-up; calling
        # the backend directly is ~4x cheaper per token and gives the same text.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend_decode = None
        if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
            self._backend_decode = backend.decode
        # Skipped special tokens decode to nothing wherever they stand, so we never put them in
        # the window: a run of them (ignore_eos) would otherwise grow it without emitting text.
        self._skip_special_tokens = skip_special_tokens
        self._skipped_ids: frozenset[int] = frozenset()
        if skip_special_tokens:
            self._skipped_ids = frozenset(
                special_token_ids(tokenizer) if special_ids is None else special_ids)
        context = self._prompt_context(self._kept(prompt_token_ids[-4 * MAX_CONTEXT_TOKENS:]))
        self._ids: list[int] = context
        self._prefix_offset = 0             # window start: tokens decoded only as context
        self._read_offset = len(context)    # tokens before this have had their text emitted
        self._next_search_at = MAX_HELD_TOKENS

    def _prompt_context(self, prompt_ids: list[int]) -> list[int]:
        """The prompt's last few tokens, chosen to start and end on whole characters.

        Starting inside a character only garbles context text that we subtract anyway, except
        under byte fallback, where it turns the whole run of byte tokens into U+FFFDs. Ending
        inside one would make the context absorb the output's first bytes: then we decode the
        output on its own, as tokenizer.decode(output_ids) does."""
        fallback: list[int] = []
        for n in (*range(PROMPT_CONTEXT_TOKENS, MAX_CONTEXT_TOKENS + 1),
                  *range(PROMPT_CONTEXT_TOKENS - 1, 0, -1)):
            if n > len(prompt_ids):
                continue
            context = prompt_ids[-n:]
            text = self._decode(context)
            if text.endswith(REPLACEMENT_CHAR):
                continue
            if not text.startswith(REPLACEMENT_CHAR):
                return context
            fallback = fallback or context
        return fallback

    def _decode(self, ids: list[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=self._skip_special_tokens)
        return self._tokenizer.decode(ids, **self._decode_kwargs)

    def _kept(self, ids: Sequence[int]) -> list[int]:
        if not self._skipped_ids:
            return list(ids)
        return [i for i in ids if i not in self._skipped_ids]

    def add(self, new_token_ids: Sequence[int]) -> str:
        """Appends output tokens; returns the text that became stable (may be empty)."""
        new_token_ids = self._kept(new_token_ids)
        if not new_token_ids:
            return ""
        self._ids.extend(new_token_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        text = self._decode(self._ids[self._prefix_offset:])
        if len(text) > len(prefix_text) and not text.endswith(REPLACEMENT_CHAR):
            return self._advance(len(self._ids), text[len(prefix_text):])
        held = len(self._ids) - self._read_offset
        if held >= self._next_search_at:
            return self._emit_through_safe_boundary(prefix_text, text)
        return ""

    def flush(self) -> str:
        """Ends the sequence: returns whatever was held back, incomplete characters included."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        text = self._decode(self._ids[self._prefix_offset:])
        return self._advance(len(self._ids), text[len(prefix_text):])

    def _advance(self, read_offset: int, new_text: str) -> str:
        self._prefix_offset, self._read_offset = self._read_offset, read_offset
        self._next_search_at = MAX_HELD_TOKENS
        if self._prefix_offset >= _TRIM_AT:
            del self._ids[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return new_text

    def _emit_through_safe_boundary(self, prefix_text: str, text: str) -> str:
        """Held tokens pile up when the output is not valid UTF-8 (the text keeps ending in
        U+FFFD), and the window would grow without end.

        Emit through the latest held token boundary where decoding the two sides apart gives
        the same text as decoding them together. If the text before it ends in a complete
        character, no later token can change it. If it ends in U+FFFD, that holds for lossy
        UTF-8 decoding of byte-level tokens (the replacement was final, since splitting a
        character would have changed the text) but not for SentencePiece byte fallback, which
        turns a whole run of byte tokens into U+FFFDs when any of it is invalid: we accept such
        a boundary only after MAX_HELD_INVALID tokens without a complete character, i.e. never
        for valid text.
        """
        window = self._ids[self._prefix_offset:]
        read = self._read_offset - self._prefix_offset
        accept_partial = len(window) - read >= MAX_HELD_INVALID
        for split in range(len(window) - 1, read, -1):
            head = self._decode(window[:split])
            if not accept_partial and head.endswith(REPLACEMENT_CHAR):
                continue
            if len(head) <= len(prefix_text) or not head.startswith(prefix_text):
                continue
            tail = self._decode(window[split:])
            if tail and head + tail == text:
                return self._advance(self._prefix_offset + split, head[len(prefix_text):])
        # Nothing safe yet (e.g. skipped special tokens after a partial character): search again
        # only after as many tokens again, so the searching stays amortised O(window) per token.
        self._next_search_at = 2 * (len(self._ids) - self._read_offset)
        return ""
