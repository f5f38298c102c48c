"""KV cache storage formats: the cache may hold K/V in a narrower dtype than the model computes in.

`--kv-cache-dtype` (vLLM's flag and names): `auto` stores the model dtype; `bfloat16`,
`float16` or `float32` store that dtype; `fp8` / `fp8_e4m3` store float8 e4m3fn (range ±448,
3 mantissa bits) and `fp8_e5m2` float8 e5m2 (range ±57344, 2 mantissa bits). Like vLLM without
calibrated scales, fp8 values are stored unscaled (scale 1.0), saturated to the format's range.

Decode attention is bound by reading the cache (every step reads every cached token's K and V),
so the cache's bytes per element are its speed: fp8 reads a quarter of fp32's bytes and fits four
times the tokens in the same memory.

Kernels widen every cached element to the query's dtype as they load it. fp8 bytes are widened
through IEEE half: e5m2 is a half's top byte; e4m3fn's exponent and mantissa bits placed in a
half (bias 15 instead of 7) give the value divided by 256, subnormals included. The C kernel
(kernels/native) and the Triton kernels (kv_format_triton.py's `load_kv`, on the cache viewed
as bytes) use that bit trick; the torch references use torch's own conversion, so tests compare
the two.
"""
from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}

# --kv-cache-dtype name -> storage dtype (None: the model's dtype)
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16,
    "float16": torch.float16, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}

# Triton's view of a cache (a kernel's KV_FORMAT): a float dtype Triton loads itself, e4m3fn
# bytes or e5m2 bytes
FORMAT_FLOAT, FORMAT_E4M3, FORMAT_E5M2 = 0, 1, 2


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype of `--kv-cache-dtype name` for a model computing in `model_dtype`."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                         f"got {name!r}")
    return KV_CACHE_DTYPES[name] or model_dtype


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def check_storage(name: str, compute_dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    """A cache may hold the compute dtype itself or a narrower float format of it."""
    if cache_dtype == compute_dtype:
        return
    narrower = is_fp8(cache_dtype) or (
        cache_dtype in (torch.bfloat16, torch.float16) and compute_dtype == torch.float32)
    if not narrower:
        raise ValueError(f"{name}: a {cache_dtype} cache cannot serve {compute_dtype} queries "
                         "(the cache holds the model dtype, bf16/fp16 under fp32, or fp8)")


def to_storage(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in the cache's dtype; fp8 saturates to the format's finite range (never NaN or inf)."""
    if x.dtype == dtype:
        return x
    if is_fp8(dtype):
        limit = FP8_MAX[dtype]
        return x.clamp(-limit, limit).to(dtype)
    return x.to(dtype)


def raw(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as bytes (CPU index_copy and Triton's interpreter have no fp8); others as is."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


def triton_format(dtype: torch.dtype) -> int:
    """The KV_FORMAT a Triton kernel takes for a cache of `dtype`."""
    fp8 = {torch.float8_e4m3fn: FORMAT_E4M3, torch.float8_e5m2: FORMAT_E5M2}
    return fp8.get(dtype, FORMAT_FLOAT)
