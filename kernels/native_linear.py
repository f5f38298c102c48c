"""fp32 linear on CPU through the native kernel (kernels/native/linear_f32.c): y = x W^T.

`pack(weight)` lays W [N, K] out as panels of 16 output columns ([ceil(N/16), K, 16], once at
load); `linear(x, packed, n)` multiplies. On the AVX2 EPYC this beats oneDNN's packed product and
MKL's sgemm at every batch size measured (1 to 1,024 rows; figures in linear_f32.c). The sums run
in another order than theirs, so results match to fp32 rounding, not bit for bit.
"""
from __future__ import annotations

import torch

from . import native
from ._checks import require

PANEL = 16


def available() -> bool:
    return native.library() is not None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """fp32 CPU weight [N, K] -> panels [ceil(N / 16), K, 16] (the last one zero-padded)."""
    require(weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2,
            f"native_linear.pack: expected a 2-D fp32 CPU weight, got {weight.dtype} "
            f"{tuple(weight.shape)} on {weight.device}")
    lib = native.library()
    require(lib is not None, f"native_linear.pack: {native.unavailable_reason()}")
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    n, k = weight.shape
    packed = torch.empty((n + PANEL - 1) // PANEL, k, PANEL, dtype=torch.float32)
    lib.linear_pack_f32(weight.data_ptr(), n, k, weight.stride(0), packed.data_ptr())
    return packed


def linear(x: torch.Tensor, packed: torch.Tensor, n: int, threads: int | None = None) -> torch.Tensor:
    """x [M, K] fp32 (rows contiguous) @ W^T -> [M, n] fp32, W packed by `pack`."""
    require(x.dtype == torch.float32 and x.dim() == 2 and x.device.type == "cpu",
            f"native_linear.linear: expected a 2-D fp32 CPU input, got {x.dtype} "
            f"{tuple(x.shape)} on {x.device}")
    m, k = x.shape
    require(packed.dim() == 3 and packed.shape[1] == k and packed.shape[2] == PANEL
            and packed.shape[0] * PANEL >= n > packed.shape[0] * PANEL - PANEL,
            f"native_linear.linear: packed weight {tuple(packed.shape)} does not fit x "
            f"{tuple(x.shape)} and n = {n}")
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty(m, n, dtype=torch.float32)
    if m == 0:
        return out
    status = native.library().linear_f32(
        x.data_ptr(), m, k, x.stride(0), packed.data_ptr(), n, out.data_ptr(), n,
        threads or torch.get_num_threads())
    require(status == 0, f"native_linear.linear: bad sizes m={m} k={k} n={n}")
    return out
