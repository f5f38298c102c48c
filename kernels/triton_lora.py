"""LoRA's segmented shrink and expand in Triton (punica's SGMV): the arguments and results of
kernels/lora_ref.py, on CUDA (and in Triton's interpreter on CPU for the tests).

One program per (segment, tile of rank columns) for shrink and per (segment, tile of output
columns) for expand: a segment's rows share one adapter, so its weight tile is loaded once per
BLOCK_M rows and multiplied by tl.dot (fp32 sums). The rows are gathered through `rows` (their
places in the step), never copied.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import require
from .lora_ref import check_segments

BLOCK_M, BLOCK_R, BLOCK_K, BLOCK_N = 16, 16, 64, 64


@triton.jit
def _sgmv_shrink_kernel(x_ptr, a_ptr, rows_ptr, starts_ptr, slots_ptr, y_ptr, K, R,
                        stride_xm, stride_as, stride_ar, stride_ym,
                        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):
    seg = tl.program_id(0)
    start = tl.load(starts_ptr + seg)
    end = tl.load(starts_ptr + seg + 1)
    a_base = a_ptr + tl.load(slots_ptr + seg) * stride_as
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    for m0 in range(start, end, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < end
        rows = tl.load(rows_ptr + offs_m, mask=mask_m, other=0)
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            x = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :],
                        mask=mask_m[:, None] & (kk[None, :] < K), other=0.0)
            a = tl.load(a_base + offs_r[None, :] * stride_ar + kk[:, None],
                        mask=(offs_r[None, :] < R) & (kk[:, None] < K), other=0.0)
            acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision=DOT_PRECISION)
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_r[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & (offs_r[None, :] < R))


@triton.jit
def _sgmv_expand_kernel(y_ptr, b_ptr, rows_ptr, starts_ptr, slots_ptr, out_ptr, R, N,
                        stride_ym, stride_bs, stride_br, stride_om,
                        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):
    seg = tl.program_id(0)
    start = tl.load(starts_ptr + seg)
    end = tl.load(starts_ptr + seg + 1)
    b_base = b_ptr + tl.load(slots_ptr + seg) * stride_bs
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    for m0 in range(start, end, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < end
        rows = tl.load(rows_ptr + offs_m, mask=mask_m, other=0)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r0 in range(0, R, BLOCK_R):
            rr = r0 + offs_r
            y = tl.load(y_ptr + offs_m[:, None] * stride_ym + rr[None, :],
                        mask=mask_m[:, None] & (rr[None, :] < R), other=0.0)
            b = tl.load(b_base + rr[:, None] * stride_br + offs_n[None, :],
                        mask=(rr[:, None] < R) & (offs_n[None, :] < N), other=0.0)
            acc += tl.dot(y.to(tl.float32), b.to(tl.float32), input_precision=DOT_PRECISION)
        mask = mask_m[:, None] & (offs_n[None, :] < N)
        out = out_ptr + rows[:, None] * stride_om + offs_n[None, :]
        prev = tl.load(out, mask=mask, other=0.0)
        tl.store(out, (prev.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=mask)


def dot_precision(dtype: torch.dtype) -> str:
    """The dots take fp32 operands (bf16 and fp16 widened in registers: LoRA's products are
    small, and the interpreter's bf16 dots are not exact): fp32 inputs exactly ("ieee"),
    widened ones in tf32, which holds their 8 or 11 mantissa bits exactly."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _check(what: str, data: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor,
           seg_starts: torch.Tensor, seg_slots: torch.Tensor) -> None:
    check_segments(what, rows, seg_starts, seg_slots, weights.shape[0])
    require(weights.dim() == 3 and weights.stride(2) == 1 and data.dim() == 2
            and data.stride(1) == 1 and data.dtype == weights.dtype
            and data.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and data.device == weights.device == rows.device == seg_starts.device,
            f"{what}: expected weights [slots, R, K|N] and rows of data of one float dtype on "
            f"one device, got {weights.dtype} {tuple(weights.shape)} on {weights.device} and "
            f"{data.dtype} {tuple(data.shape)} on {data.device}")


def shrink(x: torch.Tensor, a: torch.Tensor, rows: torch.Tensor, seg_starts: torch.Tensor,
           seg_slots: torch.Tensor) -> torch.Tensor:
    """y [len(rows), R] = A[slot] x[row] per listed row, in x's dtype (A [slots, R, K])."""
    _check("triton_lora.shrink", x, a, rows, seg_starts, seg_slots)
    _, r, k = a.shape
    require(x.shape[1] == k, f"triton_lora.shrink: x has {x.shape[1]} columns, A {k}")
    y = torch.empty(rows.numel(), r, dtype=x.dtype, device=x.device)
    if rows.numel():
        grid = (seg_slots.numel(), triton.cdiv(r, BLOCK_R))
        _sgmv_shrink_kernel[grid](x, a, rows, seg_starts, seg_slots, y, k, r, x.stride(0),
                                  a.stride(0), a.stride(1), y.stride(0), BLOCK_M=BLOCK_M,
                                  BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K,
                                  DOT_PRECISION=dot_precision(x.dtype))
    return y


def expand(y: torch.Tensor, b: torch.Tensor, rows: torch.Tensor, seg_starts: torch.Tensor,
           seg_slots: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[row, :N] += y[i] B[slot] per listed row (B [slots, R, N]; out may be a column slice
    of a wider tensor); returns out."""
    _check("triton_lora.expand", y, b, rows, seg_starts, seg_slots)
    _, r, n = b.shape
    require(y.shape == (rows.numel(), r) and out.dim() == 2 and out.shape[1] == n
            and out.stride(1) == 1 and out.dtype == y.dtype and out.device == y.device,
            f"triton_lora.expand: y {tuple(y.shape)}, B {tuple(b.shape)} and out "
            f"{tuple(out.shape)} {out.dtype} (unit column stride) do not fit")
    if rows.numel():
        grid = (seg_slots.numel(), triton.cdiv(n, BLOCK_N))
        _sgmv_expand_kernel[grid](y, b, rows, seg_starts, seg_slots, out, r, n, y.stride(0),
                                  b.stride(0), b.stride(1), out.stride(0), BLOCK_M=BLOCK_M,
                                  BLOCK_R=BLOCK_R, BLOCK_N=BLOCK_N,
                                  DOT_PRECISION=dot_precision(y.dtype))
    return out
