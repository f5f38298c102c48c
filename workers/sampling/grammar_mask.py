"""Structured output's token masks applied to a step's logits: one batched op for all rows.

The plan carries a packed bitmask per constrained sample (pipeline/structured/matchers.py,
int32 words, bit t of a row allows token t). On CPU with fp32 logits xgrammar's native kernel
applies it (about 5x faster than the torch op there); elsewhere (CUDA, bf16) the torch op
unpacks the rows' bytes with one shift-and-mask over [rows, bytes, 8] and selects -inf for
disallowed tokens. Both give the same result (tests/structured/test_structured_core.py).
"""
from __future__ import annotations

import sys

import torch

from pagedserve.pipeline.messages import GrammarMasks

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [rows, vocab_size] from int32 words [rows, ceil(vocab_size / 32)] (little-endian
    hosts: byte k of word w holds tokens 32 w + 8 k ...)."""
    shifts = _SHIFTS.get(words.device)
    if shifts is None:
        shifts = _SHIFTS[words.device] = torch.arange(8, dtype=torch.uint8, device=words.device)
    octets = words.contiguous().view(torch.uint8).view(words.shape[0], -1)
    return ((octets.unsqueeze(-1) >> shifts) & 1).view(words.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask_torch(logits: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """logits [R, V] with -inf where words [R, W] has a 0 bit; a new tensor."""
    allowed = unpack_bitmask(words.to(logits.device), logits.shape[1])
    return torch.where(allowed, logits, torch.tensor(float("-inf"), dtype=logits.dtype,
                                                     device=logits.device))


def apply_grammar_masks(logits: torch.Tensor, row_seq_ids: list[int],
                        masks: GrammarMasks) -> torch.Tensor:
    """`logits` [rows, V] (row i sampling for row_seq_ids[i]) with every token its row's
    grammar forbids at -inf; a new tensor when anything is masked, the caller's is unchanged."""
    where = {sid: r for r, sid in enumerate(masks.seq_ids)}
    pairs = [(row, where[sid]) for row, sid in enumerate(row_seq_ids) if sid in where]
    if not pairs:
        return logits
    num_rows, vocab = logits.shape
    if vocab > masks.num_words * 32:
        raise ValueError(f"grammar masks cover {masks.num_words * 32} tokens but the logits "
                         f"have {vocab}")
    words = torch.frombuffer(bytearray(masks.bitmask), dtype=torch.int32)
    words = words.view(len(masks.seq_ids), masks.num_words)
    # One mask row per logits row, all ones (allow all) where a row is unconstrained.
    rows = torch.full((num_rows, masks.num_words), -1, dtype=torch.int32)
    rows[torch.tensor([p[0] for p in pairs])] = words[torch.tensor([p[1] for p in pairs])]
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and sys.byteorder == "little":
        import xgrammar as xgr
        out = logits.clone(memory_format=torch.contiguous_format)
        xgr.apply_token_bitmask_inplace(out, rows, vocab_size=vocab,
                                        indices=[p[0] for p in pairs])
        return out
    return apply_bitmask_torch(logits, rows)
