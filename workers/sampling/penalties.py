"""Presence, frequency and repetition penalties, applied to a batch of logits at once.

Only the (row, token) pairs that occur in a row's history change, so the work is sparse: one
flat index array over all histories, `unique` + a scatter-add for the output counts, then a
gather / update / scatter of just those logits. That is O(total tokens), never O(N x V), and
has no Python loop per token.
"""
from __future__ import annotations

from itertools import chain

import numpy as np
import torch


def token_occurrences(token_ids: list[list[int]], num_prompt_tokens: list[int], vocab_size: int,
                      rows: list[int] | None = None, device: torch.device | str = "cpu"
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct tokens each history holds, and how often each occurs in its output part.

    History j belongs to logits row `rows[j]` (default j). Returns `(slots, output_counts)`:
    int64 flat indices `row * vocab_size + token` into the logits, sorted and distinct, and
    float32 counts of the occurrences after the row's first `num_prompt_tokens` tokens.
    Host bookkeeping is numpy: its `unique` measured 3-30x faster than torch's on CPU here.
    """
    rows = np.arange(len(token_ids)) if rows is None else np.asarray(rows, dtype=np.int64)
    lengths = np.fromiter(map(len, token_ids), dtype=np.int64, count=len(token_ids))
    flat_ids = np.fromiter(chain.from_iterable(token_ids), dtype=np.int64, count=int(lengths.sum()))
    history = np.repeat(np.arange(len(token_ids)), lengths)
    history_starts = np.cumsum(lengths) - lengths
    position = np.arange(flat_ids.size) - history_starts[history]
    is_output = position >= np.asarray(num_prompt_tokens, dtype=np.int64)[history]

    slots, which = np.unique(rows[history] * vocab_size + flat_ids, return_inverse=True)
    output_counts = np.bincount(which, weights=is_output, minlength=slots.size)  # scatter-add
    return (torch.from_numpy(slots).to(device),
            torch.from_numpy(output_counts.astype(np.float32)).to(device))


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
    # index_select / index_copy_, not flat_logits[slots]: on CPU advanced indexing of a
    # [64 x 152K] batch took ~8 ms per direction for 19K slots, these ~0.1 ms
    values = flat_logits.index_select(0, slots)
    rep = repetition[rows]
    values = torch.where(values > 0, values / rep, values * rep)
    values -= frequency[rows] * output_counts + presence[rows] * (output_counts > 0).float()
    flat_logits.index_copy_(0, slots, values)
    return logits
