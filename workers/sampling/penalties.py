"""Presence, frequency and repetition penalties, applied to a batch of logits at once.

Only the (row, token) pairs that occur in a row's history change, so the work is sparse: one
flat index tensor over all histories, `unique` + `scatter_add_` for the output counts, then a
gather / update / scatter of just those logits. That is O(total tokens), never O(N x V), and
has no Python loop per token.
"""
from __future__ import annotations

from itertools import chain

import torch


def token_occurrences(token_ids: list[list[int]], num_prompt_tokens: list[int], vocab_size: int,
                      rows: list[int] | None = None, device: torch.device | str = "cpu"
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct tokens each history holds, and how often each occurs in its output part.

    History j belongs to logits row `rows[j]` (default j). Returns `(slots, output_counts)`:
    int64 flat indices `row * vocab_size + token` into the logits, sorted and distinct, and
    float32 counts of the occurrences after the row's first `num_prompt_tokens` tokens.
    """
    rows = list(range(len(token_ids))) if rows is None else rows
    lengths = torch.tensor([len(ids) for ids in token_ids], dtype=torch.int64)
    flat_ids = torch.tensor(list(chain.from_iterable(token_ids)), dtype=torch.int64)
    history = torch.repeat_interleave(torch.arange(len(token_ids)), lengths)
    history_starts = torch.cumsum(lengths, 0) - lengths
    position = torch.arange(flat_ids.numel()) - history_starts[history]
    is_output = position >= torch.tensor(num_prompt_tokens, dtype=torch.int64)[history]

    flat_slots = torch.tensor(rows, dtype=torch.int64)[history] * vocab_size + flat_ids
    slots, which = torch.unique(flat_slots, return_inverse=True)
    output_counts = torch.zeros(slots.numel(), dtype=torch.float32)
    output_counts.scatter_add_(0, which, is_output.to(torch.float32))
    return slots.to(device), output_counts.to(device)


def apply_penalties(logits: torch.Tensor, slots: torch.Tensor, output_counts: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor,
                    repetition: torch.Tensor) -> torch.Tensor:
    """Penalise contiguous `logits` [N, V] in place at `slots` (see `token_occurrences`) and
    return it; the penalties are per-row [N] tensors.

    Repetition (HF/vLLM): every token seen in prompt or output has a positive logit divided by
    the penalty and a negative one multiplied by it. Presence and frequency (OpenAI), on output
    tokens only: `logit -= frequency * count + presence * (count > 0)`. Repetition goes first,
    as in vLLM.
    """
    flat_logits = logits.view(-1)
    rows = slots // logits.shape[1]
    values = flat_logits[slots]
    rep = repetition[rows]
    values = torch.where(values > 0, values / rep, values * rep)
    values -= frequency[rows] * output_counts + presence[rows] * (output_counts > 0).float()
    flat_logits[slots] = values
    return logits
