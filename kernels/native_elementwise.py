"""fp32 and bf16 RMSNorm and SiLU-and-mul on CPU through the native kernels
(kernels/native/elementwise.c).

- `rms_norm(x, weight, eps)`: x [T, H] -> rmsnorm(x) * weight, the formula of F.rms_norm.
- `fused_add_rms_norm(x, residual, weight, eps)`: residual += x in place, then returns
  rmsnorm(residual) * weight (vLLM's fused_add_rms_norm).
- `silu_mul(gate_up)`: gate_up [T, 2I] -> silu(gate_up[:, :I]) * gate_up[:, I:], [T, I].

Inputs are 2-D CPU tensors of one dtype, fp32 or bf16, whose rows are contiguous (stride 1 along
the last axis; any row stride); `supports` says whether tensors qualify and the library loads.
Results match torch's to rounding (a few fp32 ulps; bf16: computed in fp32 and rounded once,
where torch rounds silu before the product), not bit for bit: the sums and the exp run in another
order and polynomial.
"""
from __future__ import annotations

import torch

from . import native

FEATURE = "elementwise"


def available() -> bool:
    return native.library(FEATURE) is not None


_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
DTYPES = tuple(_SUFFIX)


def _rows(*tensors: torch.Tensor) -> bool:
    dtype = tensors[0].dtype
    if dtype not in _SUFFIX:
        return False
    for t in tensors:
        if t.dtype != dtype or not t.is_cpu or t.dim() != 2 or t.stride(1) != 1:
            return False
    return True


def supports(*tensors: torch.Tensor) -> bool:
    """Whether the tensors are 2-D CPU tensors of one dtype, fp32 or bf16, with contiguous rows,
    and the library loads."""
    return _rows(*tensors) and available()


def _row_stride(t: torch.Tensor) -> int:
    # a single row may carry any stride along the row axis; the kernel only needs >= width
    return t.stride(0) if t.shape[0] > 1 else t.shape[1]


def _library(name: str):
    lib = native.library(FEATURE)
    if lib is None:
        raise ValueError(f"native_elementwise.{name}: {native.unavailable_reason(FEATURE)}")
    return lib


# The checks below build their messages only on failure: these run ~60 times per decode step,
# and formatting shapes and dtypes eagerly cost ~10 us per call (measured on the 2-core EPYC).
def _check_rows(name: str, arg: str, t: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    if not _rows(t) or (dtype is not None and t.dtype != dtype):
        raise ValueError(f"native_elementwise.{name}: {arg} must be a 2-D fp32 or bf16 CPU tensor "
                         f"with contiguous rows{'' if dtype is None else f' of dtype {dtype}'}, "
                         f"got {t.dtype} {tuple(t.shape)} strides {t.stride()} on {t.device}")


def _norm(name: str, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
          eps: float, threads: int | None) -> torch.Tensor:
    _check_rows(name, "x", x)
    rows, hidden = x.shape
    if not (weight.dtype == x.dtype and weight.is_cpu and weight.shape == (hidden,)
            and weight.is_contiguous()):
        raise ValueError(f"native_elementwise.{name}: weight must be a contiguous {x.dtype} CPU "
                         f"tensor of shape ({hidden},), got {weight.dtype} "
                         f"{tuple(weight.shape)} on {weight.device}")
    if residual is not None:
        _check_rows(name, "residual", residual, x.dtype)
        if residual.shape != x.shape:
            raise ValueError(f"native_elementwise.{name}: residual shape {tuple(residual.shape)} "
                             f"!= x shape {tuple(x.shape)}")
    out = torch.empty(rows, hidden, dtype=x.dtype)
    status = getattr(_library(name), f"rms_norm_{_SUFFIX[x.dtype]}")(
        x.data_ptr(), _row_stride(x), None if residual is None else residual.data_ptr(),
        0 if residual is None else _row_stride(residual), weight.data_ptr(), eps, rows, hidden,
        out.data_ptr(), hidden, threads or torch.get_num_threads())
    if status != 0:
        raise ValueError(f"native_elementwise.{name}: bad sizes rows={rows} hidden={hidden}")
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             threads: int | None = None) -> torch.Tensor:
    """x [T, H] -> x / sqrt(mean(x^2) + eps) * weight, a new [T, H] tensor."""
    return _norm("rms_norm", x, None, weight, eps, threads)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       threads: int | None = None) -> torch.Tensor:
    """residual += x (in place); returns rms_norm(residual, weight, eps), a new [T, H] tensor."""
    return _norm("fused_add_rms_norm", x, residual, weight, eps, threads)


def silu_mul(gate_up: torch.Tensor, threads: int | None = None) -> torch.Tensor:
    """gate_up [T, 2I] -> silu(gate) * up [T, I], gate and up the halves of each row.

    silu uses exp(-|g|), so no input overflows; for g below -87.3 it returns -0 where the exact
    value is under 1.1e-36 in magnitude.
    """
    _check_rows("silu_mul", "gate_up", gate_up)
    rows, width = gate_up.shape
    if width % 2 or width == 0:
        raise ValueError(f"native_elementwise.silu_mul: gate_up needs an even, nonzero number of "
                         f"columns, got {width}")
    inter = width // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype)
    status = getattr(_library("silu_mul"), f"silu_mul_{_SUFFIX[gate_up.dtype]}")(
        gate_up.data_ptr(), _row_stride(gate_up), rows, inter, out.data_ptr(), inter,
        threads or torch.get_num_threads())
    if status != 0:
        raise ValueError(f"native_elementwise.silu_mul: bad sizes rows={rows} inter={inter}")
    return out
