"""Token id -> (text, raw bytes), for logprobs responses; cached per id."""
from __future__ import annotations


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE writes each byte as one printable character; the inverse of that map."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars: dict[int, int] = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


_BYTE_OF_CHAR = _byte_level_alphabet()


class TokenText:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel" or "ByteLevel" in repr(decoder)
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def text(self, token_id: int) -> str:
        return self._lookup(token_id)[0]

    def bytes(self, token_id: int) -> list[int]:
        return self._lookup(token_id)[1]

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            text = self.tokenizer.decode([token_id])
            raw = None
            if self._byte_level:
                piece = self.tokenizer.convert_ids_to_tokens(token_id)
                if piece and all(ch in _BYTE_OF_CHAR for ch in piece):
                    raw = [_BYTE_OF_CHAR[ch] for ch in piece]
            hit = (text, raw if raw is not None else list(text.encode("utf-8")))
            if len(self._cache) < 1 << 18:
                self._cache[token_id] = hit
        return hit
