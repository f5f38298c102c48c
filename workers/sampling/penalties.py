"""Presence, frequency and repetition penalties, applied to a batch of logits at once.

The counts are rebuilt from the token ids on every call with one scatter over a flat index
tensor; that is O(total tokens) but has no Python loop per token.
"""
from __future__ import annotations

from itertools import chain

import torch


def count_tokens(token_ids: list[list[int]], num_prompt_tokens: list[int], vocab_size: int,
                 device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, how often each vocabulary id occurs in the prompt and in the output so far.

    Returns `(prompt_counts, output_counts)`, both float32 `[len(token_ids), vocab_size]`.
    """
    num_rows = len(token_ids)
    lengths = torch.tensor([len(ids) for ids in token_ids], dtype=torch.int64)
    flat_ids = torch.tensor(list(chain.from_iterable(token_ids)), dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(num_rows), lengths)
    row_starts = torch.cumsum(lengths, 0) - lengths
    position_in_row = torch.arange(flat_ids.numel()) - row_starts[rows]
    is_output = position_in_row >= torch.tensor(num_prompt_tokens, dtype=torch.int64)[rows]

    flat_slot = (rows * vocab_size + flat_ids).to(device)
    is_output = is_output.to(device)
    ones = torch.ones(flat_slot.numel(), dtype=torch.float32, device=device)
    output_counts = torch.zeros(num_rows * vocab_size, dtype=torch.float32, device=device)
    output_counts.scatter_add_(0, flat_slot, torch.where(is_output, ones, 0.0))
    prompt_counts = torch.zeros(num_rows * vocab_size, dtype=torch.float32, device=device)
    prompt_counts.scatter_add_(0, flat_slot, torch.where(is_output, 0.0, ones))
    return (prompt_counts.view(num_rows, vocab_size), output_counts.view(num_rows, vocab_size))


def apply_penalties(logits: torch.Tensor, prompt_counts: torch.Tensor,
                    output_counts: torch.Tensor, presence: torch.Tensor,
                    frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """Penalise `logits` `[N, V]` in place and return it; per-row penalties are `[N]` tensors.

    Repetition (HF/vLLM): every token seen in prompt or output has a positive logit divided by
    the penalty and a negative one multiplied by it. Presence and frequency (OpenAI), on output
    tokens only: `logit -= frequency * count + presence * (count > 0)`. Repetition goes first,
    as in vLLM.
    """
    seen = (prompt_counts > 0) | (output_counts > 0)
    rep = repetition.unsqueeze(1)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits.copy_(torch.where(seen, penalised, logits))
    logits -= frequency.unsqueeze(1) * output_counts
    logits -= presence.unsqueeze(1) * (output_counts > 0).to(logits.dtype)
    return logits
