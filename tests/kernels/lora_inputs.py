"""A step's rows mapped to LoRA slots as the workers group them (kernels/lora_ref.py): the
inputs the native and Triton kernel tests share."""
from __future__ import annotations

import torch


def segments(row_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, seg_starts, seg_slots) of rows whose slot is >= 0, grouped by slot, rows of one
    slot in their batch order."""
    order = torch.argsort(row_slots, stable=True)
    rows = order[row_slots[order] >= 0].contiguous()
    slots, counts = torch.unique_consecutive(row_slots[rows], return_counts=True)
    starts = torch.zeros(slots.numel() + 1, dtype=torch.int64)
    starts[1:] = counts.cumsum(0)
    return rows, starts, slots.contiguous()


def random_step(num_rows: int, num_slots: int, k: int, rank: int, n: int, seed: int):
    """x [T, K], A [S, R, K], B [S, R, N] and each row's slot (-1: the base model alone)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, k, generator=gen)
    a = torch.randn(num_slots, rank, k, generator=gen) / k ** 0.5
    b = torch.randn(num_slots, rank, n, generator=gen)
    row_slots = torch.randint(-1, num_slots, (num_rows,), generator=gen)
    return x, a, b, row_slots
