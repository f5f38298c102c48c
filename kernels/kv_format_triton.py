"""`load_kv`: a cache tile read in a Triton kernel and widened to the compute dtype, for every
storage format of kernels/kv_format.py (fp8 as bytes, through IEEE half: see its docstring).
Apart from kv_format.py so that the CPU paths never import Triton."""
from __future__ import annotations

import triton
import triton.language as tl

from . import kv_format

# constexpr globals, so load_kv can branch on them
FORMAT_FLOAT = tl.constexpr(kv_format.FORMAT_FLOAT)
FORMAT_E4M3 = tl.constexpr(kv_format.FORMAT_E4M3)
FORMAT_E5M2 = tl.constexpr(kv_format.FORMAT_E5M2)


@triton.jit
def load_kv(ptrs, mask, FORMAT: tl.constexpr, DTYPE: tl.constexpr):
    """A cache tile widened to DTYPE; fp8 caches come as bytes (see the module docstring)."""
    if FORMAT == FORMAT_FLOAT:
        return tl.load(ptrs, mask=mask, other=0.0).to(DTYPE)
    bits = tl.load(ptrs, mask=mask, other=0).to(tl.uint16)
    if FORMAT == FORMAT_E4M3:
        bits = ((bits & 0x7F) << 7) | ((bits & 0x80) << 8)
        return (bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0).to(DTYPE)
    bits = bits << 8
    return bits.to(tl.float16, bitcast=True).to(DTYPE)
