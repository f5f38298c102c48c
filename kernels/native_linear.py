"""fp32 and bf16 linears on CPU through the native panel GEMM (kernels/native/linear_panels.h,
linear_f32.c, linear_bf16.c): y = x W^T.

`pack(weight)` lays W [N, K] out as panels of 16 output columns ([ceil(N/16), K, 16], once at
load); `linear(x, packed, n)` multiplies, in the weight's dtype.
- fp32: on the AVX2 EPYC this beats oneDNN's packed product and MKL's sgemm at every batch size
  measured (1 to 1,024 rows; figures in linear_f32.c).
- bf16: for CPUs without bf16 math, where torch's bf16 product is emulated (~17 GFLOP/s on the
  AVX2 EPYC). The weights stay bf16 and are widened to fp32 in registers; sums in fp32, the result
  rounded to bf16 (linear_bf16.c).
The sums run in another order than torch's, so results match to rounding, not bit for bit.
"""
from __future__ import annotations

import torch

from . import native
from ._checks import require
from ._workspace import scratch

FEATURE = "linear"
PANEL = 16
DTYPES = (torch.float32, torch.bfloat16)


def available() -> bool:
    return native.library(FEATURE) is not None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """fp32 or bf16 CPU weight [N, K] -> panels [ceil(N / 16), K, 16] of its dtype (the last one
    zero-padded)."""
    require(weight.dtype in DTYPES and weight.device.type == "cpu" and weight.dim() == 2,
            f"native_linear.pack: expected a 2-D fp32 or bf16 CPU weight, got {weight.dtype} "
            f"{tuple(weight.shape)} on {weight.device}")
    lib = native.library(FEATURE)
    require(lib is not None, f"native_linear.pack: {native.unavailable_reason(FEATURE)}")
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    n, k = weight.shape
    packed = torch.empty((n + PANEL - 1) // PANEL, k, PANEL, dtype=weight.dtype)
    pack_fn = lib.linear_pack_f32 if weight.dtype == torch.float32 else lib.linear_pack_bf16
    pack_fn(weight.data_ptr(), n, k, weight.stride(0), packed.data_ptr())
    return packed


def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The weight [n, K] that `pack` laid out (tests, debugging)."""
    return packed.permute(0, 2, 1).reshape(-1, packed.shape[1])[:n].contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, n: int, threads: int | None = None) -> torch.Tensor:
    """x [M, K] (rows contiguous) @ W^T -> [M, n], x and the result in the packed weight's dtype
    (fp32 or bf16), W packed by `pack`."""
    require(x.dtype == packed.dtype and x.dtype in DTYPES and x.dim() == 2
            and x.device.type == "cpu",
            f"native_linear.linear: expected a 2-D CPU input of the weight's dtype "
            f"({packed.dtype}), got {x.dtype} {tuple(x.shape)} on {x.device}")
    m, k = x.shape
    require(packed.dim() == 3 and packed.shape[1] == k and packed.shape[2] == PANEL
            and packed.shape[0] * PANEL >= n > packed.shape[0] * PANEL - PANEL,
            f"native_linear.linear: packed weight {tuple(packed.shape)} does not fit x "
            f"{tuple(x.shape)} and n = {n}")
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype)
    if m == 0:
        return out
    lib, threads = native.library(FEATURE), threads or torch.get_num_threads()
    if x.dtype == torch.float32:
        status = lib.linear_f32(x.data_ptr(), m, k, x.stride(0), packed.data_ptr(), n,
                                out.data_ptr(), n, threads)
    else:
        widened = scratch("native_linear_bf16_x", (m, k), torch.float32, x.device)
        status = lib.linear_bf16(x.data_ptr(), m, k, x.stride(0), packed.data_ptr(), n,
                                 out.data_ptr(), n, widened.data_ptr(), threads)
    require(status == 0, f"native_linear.linear: bad sizes m={m} k={k} n={n}")
    return out
