"""LoRA's segmented shrink and expand on CPU, fp32 (kernels/native/lora.c): the same
arguments and results as kernels/lora_ref.py, in another summation order."""
from __future__ import annotations

import torch

from . import native
from .lora_ref import check_segments

FEATURE = "lora"


def available() -> bool:
    return native.library(FEATURE) is not None


def supports(*tensors: torch.Tensor) -> bool:
    """Whether these run natively: fp32 CPU tensors, the library built."""
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors) \
        and available()


def _check(what: str, data: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor,
           seg_starts: torch.Tensor, seg_slots: torch.Tensor) -> None:
    """Shapes, dtypes and devices only; plain ifs, so that a message is formatted only when a
    check fails (these run 4 times a layer in every adapter step)."""
    check_segments(what, rows, seg_starts, seg_slots, weights.shape[0])
    if not (weights.dim() == 3 and weights.is_contiguous() and data.dim() == 2
            and data.stride(1) == 1 and supports(data, weights)
            and rows.device.type == seg_starts.device.type == seg_slots.device.type == "cpu"
            and rows.is_contiguous() and seg_starts.is_contiguous()
            and seg_slots.is_contiguous()):
        raise ValueError(f"{what}: expected contiguous fp32 CPU weights [slots, R, K|N], rows "
                         f"of fp32 data and contiguous CPU segments, got {weights.dtype} "
                         f"{tuple(weights.shape)} and {data.dtype} {tuple(data.shape)} on "
                         f"{data.device}")


def shrink(x: torch.Tensor, a: torch.Tensor, rows: torch.Tensor, seg_starts: torch.Tensor,
           seg_slots: torch.Tensor, threads: int | None = None) -> torch.Tensor:
    """y [len(rows), R] = A[slot] x[row] per listed row (A [slots, R, K])."""
    _check("native_lora.shrink", x, a, rows, seg_starts, seg_slots)
    slots, r, k = a.shape
    if x.shape[1] != k:
        raise ValueError(f"native_lora.shrink: x has {x.shape[1]} columns, A {k}")
    y = torch.empty(rows.numel(), r, dtype=torch.float32)
    if not rows.numel():
        return y
    status = native.library(FEATURE).lora_shrink_f32(
        x.data_ptr(), x.stride(0), k, rows.data_ptr(), seg_starts.data_ptr(),
        seg_slots.data_ptr(), seg_slots.numel(), a.data_ptr(), slots, r, y.data_ptr(), r,
        threads or torch.get_num_threads())
    if status != 0:
        raise ValueError(f"native_lora.shrink: bad sizes or segments (status {status}): "
                         f"x {tuple(x.shape)}, A {tuple(a.shape)}, {seg_slots.numel()} segments")
    return y


def expand(y: torch.Tensor, b: torch.Tensor, rows: torch.Tensor, seg_starts: torch.Tensor,
           seg_slots: torch.Tensor, out: torch.Tensor, threads: int | None = None
           ) -> torch.Tensor:
    """out[row, :N] += y[i] B[slot] per listed row (B [slots, R, N]; out may be a column slice
    of a wider tensor); returns out."""
    _check("native_lora.expand", y, b, rows, seg_starts, seg_slots)
    slots, r, n = b.shape
    if not (y.shape == (rows.numel(), r) and out.dim() == 2 and out.shape[1] == n
            and out.stride(1) == 1 and supports(out)):
        raise ValueError(f"native_lora.expand: y {tuple(y.shape)}, B {tuple(b.shape)} and out "
                         f"{tuple(out.shape)} (fp32, unit column stride) do not fit")
    if not rows.numel():
        return out
    status = native.library(FEATURE).lora_expand_f32(
        y.data_ptr(), y.stride(0), r, rows.data_ptr(), seg_starts.data_ptr(),
        seg_slots.data_ptr(), seg_slots.numel(), b.data_ptr(), slots, n, out.data_ptr(),
        out.stride(0), threads or torch.get_num_threads())
    if status != 0:
        raise ValueError(f"native_lora.expand: bad sizes or segments (status {status})")
    return out
