"""Structured output's token masks applied to a step's logits: one batched op for all rows.

The plan carries a packed bitmask per constrained sample (pipeline/structured/matchers.py,
int32 words, bit t of a row allows token t). The rows are unpacked with one shift-and-mask
over [rows, words, 32] and disallowed logits set to -inf, on whatever device the logits are.
"""
from __future__ import annotations

import torch

from pagedserve.pipeline.messages import GrammarMasks

_SHIFTS_CACHE: dict[torch.device, torch.Tensor] = {}


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [rows, vocab_size] from int32 words [rows, ceil(vocab_size / 32)]."""
    shifts = _SHIFTS_CACHE.get(words.device)
    if shifts is None:
        shifts = _SHIFTS_CACHE[words.device] = torch.arange(32, dtype=torch.int32,
                                                            device=words.device)
    bits = (words.unsqueeze(-1) >> shifts) & 1
    return bits.view(words.shape[0], -1)[:, :vocab_size].bool()


def apply_grammar_masks(logits: torch.Tensor, row_seq_ids: list[int],
                        masks: GrammarMasks) -> torch.Tensor:
    """`logits` [rows, V] (row i sampling for row_seq_ids[i]) with every token its row's
    grammar forbids at -inf; a new tensor when anything is masked, the caller's is unchanged."""
    where = {sid: r for r, sid in enumerate(masks.seq_ids)}
    pairs = [(row, where[sid]) for row, sid in enumerate(row_seq_ids) if sid in where]
    if not pairs:
        return logits
    vocab = logits.shape[1]
    if vocab > masks.num_words * 32:
        raise ValueError(f"grammar masks cover {masks.num_words * 32} tokens but the logits "
                         f"have {vocab}")
    words = torch.frombuffer(bytearray(masks.bitmask), dtype=torch.int32)
    words = words.view(len(masks.seq_ids), masks.num_words)
    logit_rows = torch.tensor([p[0] for p in pairs], device=logits.device)
    mask_rows = torch.tensor([p[1] for p in pairs])
    allowed = unpack_bitmask(words[mask_rows].to(logits.device), vocab)
    out = logits.clone()
    out[logit_rows] = logits[logit_rows].masked_fill(~allowed, float("-inf"))
    return out
