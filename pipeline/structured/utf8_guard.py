"""What xgrammar lets through that is not UTF-8: its character classes take ED A0..BF, the
encoding of a UTF-16 surrogate (U+D800..DFFF), which no valid UTF-8 holds; the detokenizer then
writes U+FFFD where the model meant a character. (It rejects every other invalid sequence:
lone continuations, overlongs, F5..FF, beyond U+10FFFF.) The guard clears those tokens from a
row of the packed bitmask: always the tokens whose own bytes hold ED A0..BF, and, while the
output so far ends in the lead byte ED, the tokens that begin with A0..BF."""
from __future__ import annotations

_LEAD = 0xED
_SURROGATE_SECOND = range(0xA0, 0xC0)


def _has_surrogate(data: bytes) -> bool:
    i = data.find(_LEAD)
    while 0 <= i < len(data) - 1:
        if data[i + 1] in _SURROGATE_SECOND:
            return True
        i = data.find(_LEAD, i + 1)
    return False


class Utf8Guard:
    def __init__(self, decoded_vocab: list[bytes], num_words: int) -> None:
        import torch
        self.ends_in_lead = [bool(b) and b[-1] == _LEAD for b in decoded_vocab]
        always = [t for t, b in enumerate(decoded_vocab) if _has_surrogate(b)]
        after_lead = always + [t for t, b in enumerate(decoded_vocab)
                               if b and b[0] in _SURROGATE_SECOND]
        self._keep_always = self._keep_mask(always, num_words, torch)
        self._keep_after_lead = self._keep_mask(after_lead, num_words, torch)

    @staticmethod
    def _keep_mask(banned: list[int], num_words: int, torch):
        keep = torch.full((num_words,), -1, dtype=torch.int32)
        for t in banned:
            word, bit = divmod(t, 32)
            keep[word] &= ~(1 << bit) if bit < 31 else 0x7FFFFFFF  # int32: bit 31 is the sign
        return keep

    def apply(self, row, last_token: int | None) -> None:
        """Clear the surrogate-making tokens from `row` (one int32 bitmask row, in place)."""
        pending_lead = last_token is not None and last_token < len(self.ends_in_lead) \
            and self.ends_in_lead[last_token]
        row &= self._keep_after_lead if pending_lead else self._keep_always
