"""y = x W^T with W kept in a block format (kernels/quant_formats.py): the Triton kernel reads
the raw block bytes, dequantizes a [BLOCK_K, BLOCK_N] tile of W^T in registers (fp32) and feeds
it to tl.dot with fp32 accumulation. One kernel for every type: QTYPE is a constexpr, so each
type compiles to its own straight-line dequantization.

Byte layouts, per block (GGUF's, as ggml and gguf-py define them; d, dmin: fp16 little-endian):
  Q4_0  [d | 16 B nibbles]                    element j: low nibble of byte j % 16 for j < 16,
                                              high nibble for j >= 16; d * (q - 8)
  Q4_1  [d | m | 16 B nibbles]                d * q + m
  Q5_0  [d | 4 B high bits | 16 B nibbles]    q = nibble | bit j of the 32-bit word << 4; d * (q - 16)
  Q8_0  [d | 32 int8]                         d * q
  Q4_K  [d | dmin | 12 B scales | 128 B]      8 sub-blocks of 32 with 6-bit scale and min
                                              (packed as llama.cpp's get_scale_min_k4); element
                                              e: byte 32 * (e // 64) + e % 32, nibble (e // 32) % 2;
                                              d * sc * q - dmin * m
  Q5_K  [d | dmin | 12 B scales | 32 B high bits | 128 B]   as Q4_K, plus bit e // 32 of high
                                              byte e % 32 as q's fifth bit
  Q6_K  [128 B low | 64 B high | 16 int8 scales | d]        half h = e // 128, r = e % 128:
                                              low nibble r // 64 of byte 64 h + r % 64, two bits
                                              2 (r // 32) of byte 32 h + r % 32; scale e // 16;
                                              d * sc * (q - 32)
  I4G   [fp32 d | fp32 m | 16 B nibbles]      as Q4_1 with fp32 d and m
Scales are assembled from single bytes, so no block needs any alignment.

Operands of the dot: fp32 activations with fp32 tiles ("ieee": exact); fp16 activations with the
tile rounded to fp16; bf16 activations widened to fp32 with fp32 tiles ("tf32" on the GPU: W keeps
10 mantissa bits rather than bf16's 7, and the interpreter's bf16 dots are not exact).
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from . import _checks
from ._checks import require
from .quant_formats import BLOCKS, QType, QuantizedWeight


@triton.jit
def _f16(ptr, mask):
    """The little-endian fp16 at ptr (any alignment), as fp32."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _f32(ptr, mask):
    """The little-endian fp32 at ptr (any alignment)."""
    word = tl.load(ptr, mask=mask, other=0).to(tl.uint32)
    word |= tl.load(ptr + 1, mask=mask, other=0).to(tl.uint32) << 8
    word |= tl.load(ptr + 2, mask=mask, other=0).to(tl.uint32) << 16
    word |= tl.load(ptr + 3, mask=mask, other=0).to(tl.uint32) << 24
    return word.to(tl.float32, bitcast=True)


@triton.jit
def _nibble(ptr, e, mask):
    """Element e (0..31) of 16 bytes of nibbles: low nibbles first, then high ones."""
    byte = tl.load(ptr + e % 16, mask=mask, other=0).to(tl.int32)
    return ((byte >> (e // 16 * 4)) & 0xF).to(tl.float32)


@triton.jit
def _k_scale_min(ptr, j, mask):
    """Sub-block j's 6-bit (scale, min) from Q4_K/Q5_K's 12 bytes at ptr (get_scale_min_k4):
    bytes 0-3 and 4-7 hold j < 4's scale and min in their low 6 bits; j >= 4 takes its low 4
    bits from byte j + 4 (scale: low nibble, min: high nibble) and its top 2 bits from the top
    of bytes j - 4 (scale) and j (min)."""
    a = tl.load(ptr + j, mask=mask, other=0).to(tl.int32)            # byte j
    b = tl.load(ptr + j + 4, mask=mask, other=0).to(tl.int32)        # byte j + 4 (<= 11)
    c = tl.load(ptr + j % 4, mask=mask, other=0).to(tl.int32)        # byte j - 4 when j >= 4
    low = j < 4
    scale = tl.where(low, a & 63, (b & 0xF) | ((c >> 6) << 4))
    minimum = tl.where(low, b & 63, (b >> 4) | ((a >> 6) << 4))
    return scale.to(tl.float32), minimum.to(tl.float32)


@triton.jit
def _dequant(rows_ptr, cols, mask, QTYPE: tl.constexpr):
    """W[rows, cols] as fp32: rows_ptr points at each row's first byte, cols are element indices
    (they broadcast against each other); masked-out elements read as 0."""
    if QTYPE == 2:      # Q4_0
        base = rows_ptr + cols // 32 * 18
        w = _f16(base, mask) * (_nibble(base + 2, cols % 32, mask) - 8.0)
    elif QTYPE == 3:    # Q4_1
        base = rows_ptr + cols // 32 * 20
        w = _f16(base, mask) * _nibble(base + 4, cols % 32, mask) + _f16(base + 2, mask)
    elif QTYPE == 6:    # Q5_0
        base = rows_ptr + cols // 32 * 22
        e = cols % 32
        high = (tl.load(base + 2 + e // 8, mask=mask, other=0).to(tl.int32) >> (e % 8)) & 1
        w = _f16(base, mask) * (_nibble(base + 6, e, mask) + high.to(tl.float32) * 16.0 - 16.0)
    elif QTYPE == 8:    # Q8_0
        base = rows_ptr + cols // 32 * 34
        q = tl.load(base + 2 + cols % 32, mask=mask, other=0).to(tl.int8, bitcast=True)
        w = _f16(base, mask) * q.to(tl.float32)
    elif QTYPE == 12 or QTYPE == 13:    # Q4_K, Q5_K
        base = rows_ptr + cols // 256 * (144 if QTYPE == 12 else 176)
        e = cols % 256
        j = e // 32
        scale, minimum = _k_scale_min(base + 4, j, mask)
        quants = base + (16 if QTYPE == 12 else 48)
        low = tl.load(quants + e // 64 * 32 + e % 32, mask=mask, other=0).to(tl.int32)
        q = (low >> (j % 2 * 4)) & 0xF
        if QTYPE == 13:
            high = tl.load(base + 16 + e % 32, mask=mask, other=0).to(tl.int32)
            q |= ((high >> j) & 1) << 4
        w = (_f16(base, mask) * scale) * q.to(tl.float32) - _f16(base + 2, mask) * minimum
    elif QTYPE == 14:   # Q6_K
        base = rows_ptr + cols // 256 * 210
        e = cols % 256
        half = e // 128
        r = e % 128
        low = tl.load(base + half * 64 + r % 64, mask=mask, other=0).to(tl.int32)
        high = tl.load(base + 128 + half * 32 + r % 32, mask=mask, other=0).to(tl.int32)
        q = ((low >> (r // 64 * 4)) & 0xF) | (((high >> (r // 32 * 2)) & 3) << 4)
        scale = tl.load(base + 192 + e // 16, mask=mask, other=0).to(tl.int8, bitcast=True)
        w = (_f16(base + 208, mask) * scale.to(tl.float32)) * (q - 32).to(tl.float32)
    else:               # I4G
        tl.static_assert(QTYPE == 1000, "unknown QTYPE")
        base = rows_ptr + cols // 32 * 24
        w = _f32(base, mask) * _nibble(base + 8, cols % 32, mask) + _f32(base + 4, mask)
    return w


@triton.jit
def _quant_linear_kernel(
    x_ptr, w_ptr, perm_ptr, y_ptr, M, N, K,
    stride_xm, stride_xk, stride_wn, stride_ym,
    QTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_PERM: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # One program per [BLOCK_M, BLOCK_N] tile of y; programs along N come first in the grid, so
    # a decode step's few rows of x spread over the whole weight. BLOCK_K divides K and, for the
    # 256-element types, a super-block: no mask along K.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = rows_m < M
    mask_n = rows_n < N
    ks = tl.arange(0, BLOCK_K)
    # W^T tile [BLOCK_K, BLOCK_N]: each column a row of W
    w_rows = w_ptr + rows_n.to(tl.int64)[None, :] * stride_wn
    x_rows = x_ptr + rows_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + ks
        if HAS_PERM:
            x_cols = tl.load(perm_ptr + cols)
        else:
            x_cols = cols
        x = tl.load(x_rows + x_cols[None, :] * stride_xk, mask=mask_m[:, None], other=0.0)
        w = _dequant(w_rows, cols[:, None], mask_n[None, :], QTYPE)
        acc = tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)
    y = y_ptr + rows_m.to(tl.int64)[:, None] * stride_ym + rows_n[None, :]
    if y_ptr.dtype.element_ty == tl.bfloat16:
        # round to nearest even by hand (what the GPU's cast does): the interpreter's truncates
        bits = acc.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        acc = bits.to(tl.float32, bitcast=True)
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


_ACTIVATIONS = (torch.float32, torch.float16, torch.bfloat16)


def dot_operands(dtype: torch.dtype) -> tuple:
    """(DOT_DTYPE, DOT_PRECISION) for activations of this dtype (see the module docstring)."""
    if dtype == torch.float16:
        return tl.float16, "tf32"           # precision is unused by fp16 dots
    return tl.float32, "ieee" if dtype == torch.float32 else "tf32"


def tiles(m: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) for m rows of x and k columns."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    return block_m, 64, 64 if k % 64 == 0 else 32


def _check(x: torch.Tensor, w: QuantizedWeight) -> None:
    require(isinstance(w, QuantizedWeight),
            f"quant_linear: w must be a QuantizedWeight, got {type(w).__name__}")
    require(w.qtype in BLOCKS, f"quant_linear: no kernel for weight type {w.qtype!r}")
    require(x.dtype in _ACTIVATIONS,
            f"quant_linear: x must be fp32, fp16 or bf16, got {x.dtype}")
    require(x.dim() >= 1 and x.shape[-1] == w.k,
            f"quant_linear: x {tuple(x.shape)} has {x.shape[-1] if x.dim() else 0} columns but "
            f"the {QType(w.qtype).name} weight {w.shape} has k = {w.k}")
    require(x.device == w.data.device,
            f"quant_linear: x on {x.device} but the weight on {w.data.device}")
    require(w.data.stride(1) == 1,
            f"quant_linear: the weight's rows of bytes must be contiguous, got strides "
            f"{w.data.stride()}")
    if w.perm is not None:
        require(w.perm.dtype == torch.int64 and w.perm.shape == (w.k,)
                and w.perm.device == x.device,
                f"quant_linear: perm must be int64 [{w.k}] on {x.device}, got {w.perm.dtype} "
                f"{tuple(w.perm.shape)} on {w.perm.device}")


def quant_linear(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """y = x W^T, W = w dequantized: x [..., k] fp32/fp16/bf16 -> y [..., n] in x's dtype
    (fp32 accumulation; with w.perm, x[..., perm] multiplies the stored columns)."""
    _check(x, w)
    n, k = w.shape
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    y = _checks.new_output((m, n), x)
    if m and n:
        block_m, block_n, block_k = tiles(m, k)
        dot_dtype, precision = dot_operands(x.dtype)
        perm = w.perm.contiguous() if w.perm is not None else w.data     # data: unused
        _quant_linear_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, block_m))](
            x2, w.data, perm, y, m, n, k,
            x2.stride(0), x2.stride(1), w.data.stride(0), y.stride(0),
            QTYPE=int(w.qtype), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            HAS_PERM=w.perm is not None, DOT_DTYPE=dot_dtype, DOT_PRECISION=precision,
        )
    return y.reshape(*x.shape[:-1], n)


def quant_linear_ref(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """Torch reference of quant_linear: dequantize all of W (fp32), multiply, cast to x's dtype."""
    _check(x, w)
    on_cpu = dataclasses.replace(w, data=w.data.cpu(),
                                 perm=None if w.perm is None else w.perm.cpu())
    weight = on_cpu.dequantize(torch.float32).to(x.device)
    return (x.float() @ weight.T).to(x.dtype)
