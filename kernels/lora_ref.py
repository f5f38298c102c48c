"""LoRA's segmented products in torch: the reference the native and Triton kernels are tested
against, and the path where neither runs (bf16 on CPU, no compiler).

A step's rows that use an adapter are listed in `rows`, grouped by slot: segment s holds
rows[seg_starts[s]:seg_starts[s + 1]], which use slot seg_slots[s] (punica's SGMV layout).
- shrink: y[i] = A[slot] @ x[rows[i]]           A [slots, R, K] -> y [len(rows), R]
- expand: out[rows[i], :N] += y[i] @ B[slot]    B [slots, R, N], rank-major (scaling folded in)
"""
from __future__ import annotations

import torch

from ._checks import require


def check_segments(what: str, rows: torch.Tensor, seg_starts: torch.Tensor,
                   seg_slots: torch.Tensor, num_slots: int) -> None:
    """Shapes only: int64 rows [n], seg_starts [S + 1], seg_slots [S], on one device."""
    if not (rows.dtype == seg_starts.dtype == seg_slots.dtype == torch.int64
            and rows.dim() == seg_starts.dim() == seg_slots.dim() == 1
            and seg_starts.numel() == seg_slots.numel() + 1):
        raise ValueError(f"{what}: rows [n], seg_starts [S + 1] and seg_slots [S] must be 1-D "
                         f"int64, got {tuple(rows.shape)} {rows.dtype}, "
                         f"{tuple(seg_starts.shape)} {seg_starts.dtype}, "
                         f"{tuple(seg_slots.shape)} {seg_slots.dtype}")
    require(num_slots > 0, f"{what}: the weight stack has no slots")


def shrink_ref(x: torch.Tensor, a: torch.Tensor, rows: torch.Tensor, seg_starts: torch.Tensor,
               seg_slots: torch.Tensor) -> torch.Tensor:
    """y [len(rows), R] in x's dtype (fp32 sums)."""
    check_segments("shrink_ref", rows, seg_starts, seg_slots, a.shape[0])
    y = torch.zeros(rows.numel(), a.shape[1], dtype=torch.float32, device=x.device)
    for s, slot in enumerate(seg_slots.tolist()):
        lo, hi = int(seg_starts[s]), int(seg_starts[s + 1])
        y[lo:hi] = x[rows[lo:hi]].float() @ a[slot].float().t()
    return y.to(x.dtype)


def expand_ref(y: torch.Tensor, b: torch.Tensor, rows: torch.Tensor, seg_starts: torch.Tensor,
               seg_slots: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [T, N] (a view may be given) gains each listed row's y[i] @ B[slot]; returns out."""
    check_segments("expand_ref", rows, seg_starts, seg_slots, b.shape[0])
    for s, slot in enumerate(seg_slots.tolist()):
        lo, hi = int(seg_starts[s]), int(seg_starts[s + 1])
        index = rows[lo:hi]
        out[index] += (y[lo:hi].float() @ b[slot].float()).to(out.dtype)
    return out
