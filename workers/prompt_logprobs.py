"""Prompt logprobs (vLLM's SamplingParams.prompt_logprobs), computed in the prefill.

A prefill chunk's row at position p predicts prompt token p + 1. For the rows of the chunks
that asked, the LM head runs on those rows too (not only the last), a slice of rows at a time,
so at most SLICE_ROWS x vocab fp32 logits exist at once whatever the prompt's length: each
slice's log_softmax gives the logprob of the actual next token and the top-N, and is dropped.
Like the sampled logprobs (workers/sampler.py), these are the raw model logits' logprobs.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

SLICE_ROWS = 256

# One item's result: the logprob of each target token, and each row's top-N (id, logprob)
RowLogprobs = tuple[list[float], list[list[tuple[int, float]]]]


def prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor],
                    hidden: torch.Tensor, items: list[tuple[int, list[int], int]]
                    ) -> list[RowLogprobs]:
    """For each item (first row in `hidden`, the tokens its rows predict, top-N), in order:
    the target tokens' logprobs and each row's top-N. `compute_logits(hidden rows)` is the
    model's LM head (fp32 [rows, vocab], a buffer it may reuse: read before the next call)."""
    rows = torch.cat([torch.arange(first, first + len(targets)) for first, targets, _ in items])
    targets = torch.tensor([t for _, item_targets, _ in items for t in item_targets],
                           dtype=torch.int64)
    max_top = max(top for _, _, top in items)
    chosen: list[float] = []
    top_ids: list[list[int]] = []
    top_values: list[list[float]] = []
    device = hidden.device
    for start in range(0, len(rows), SLICE_ROWS):
        index = rows[start:start + SLICE_ROWS].to(device)
        logprobs = torch.log_softmax(compute_logits(hidden[index]), dim=1)
        target = targets[start:start + SLICE_ROWS].to(device).unsqueeze(1)
        chosen += logprobs.gather(1, target).squeeze(1).tolist()
        if max_top:
            values, ids = logprobs.topk(max_top, dim=1)
            top_values += values.tolist()
            top_ids += ids.tolist()
    out, at = [], 0
    for _, item_targets, top in items:
        end = at + len(item_targets)
        tops = [list(zip(top_ids[r][:top], top_values[r][:top])) if top else []
                for r in range(at, end)]
        out.append((chosen[at:end], tops))
        at = end
    return out
