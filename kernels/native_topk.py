"""Each row's k largest fp32 values and their indices through kernels/native/topk.c: what
`torch.topk(x, k, dim=1)` returns (sorted, largest first) in about one read of each row, for the
sampler's candidates and its greedy argmax.

Equal values come lower index first (k = 1 is `argmax`'s first maximum); NaN ranks as -inf
(torch ranks it largest). `supports(x, k)` says whether the kernel takes `x` and `k`.
"""
from __future__ import annotations

import functools

import torch

from . import native

FEATURE = "topk"


@functools.cache
def _limit(lib) -> int:
    return lib.topk_max_k()


def _max_k() -> int:
    """The kernel's largest k (asked once per loaded library: the sampler calls this per step)."""
    lib = native.library(FEATURE)
    return 0 if lib is None else _limit(lib)


def supports(x: torch.Tensor, k: int) -> bool:
    """x a 2-D fp32 CPU tensor with contiguous rows, 1 <= k <= min(columns, the kernel's
    limit), and the library loads."""
    return (x.dtype == torch.float32 and x.is_cpu and x.dim() == 2 and x.stride(1) == 1
            and x.shape[1] > 0 and 1 <= k <= x.shape[1] and k <= _max_k())


def topk(x: torch.Tensor, k: int, threads: int | None = None
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [rows, k] fp32, indices [rows, k] int64) of each row's k largest, descending."""
    if not supports(x, k):
        raise ValueError(f"native_topk.topk: needs a 2-D fp32 CPU tensor with contiguous rows "
                         f"and 1 <= k <= min(columns, {_max_k()}) with the library loaded "
                         f"({native.unavailable_reason(FEATURE) or 'it loads'}), got {x.dtype} "
                         f"{tuple(x.shape)} strides {x.stride()} on {x.device}, k={k}")
    return _run(x, k, threads)


def _run(x: torch.Tensor, k: int, threads: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    rows, n = x.shape
    values = torch.empty(rows, k, dtype=torch.float32)
    ids = torch.empty(rows, k, dtype=torch.int64)
    if rows:
        stride = x.stride(0) if rows > 1 else n
        status = native.library(FEATURE).topk_f32(
            x.data_ptr(), stride, rows, n, k, values.data_ptr(), ids.data_ptr(),
            threads or torch.get_num_threads())
        if status != 0:
            raise ValueError(f"native_topk.topk: bad sizes rows={rows} n={n} k={k}")
    return values, ids


def topk_or_torch(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`topk` where the kernel takes `x`, else torch's: `argmax` for k = 1 (the first maximum,
    as the kernel's), torch.topk otherwise (the same order but for ties and NaN)."""
    if supports(x, k):
        return _run(x, k, None)
    if k == 1:
        ids = x.argmax(dim=1, keepdim=True)
        return x.gather(1, ids), ids
    return torch.topk(x, k, dim=1)
