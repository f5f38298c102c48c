"""Argument checks shared by the Triton wrappers and the torch references.

They only read shapes, dtypes, devices and strides (never tensor values), so they cost
microseconds and never synchronize a device.
"""
from __future__ import annotations

import torch

from .kv_format import check_storage


def require(condition: bool, message: str) -> None:
    """Raise ValueError(message) unless condition holds (unlike assert, survives python -O)."""
    if not condition:
        raise ValueError(message)


def check_cache_pair(name: str, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """k_cache and v_cache are layer views [num_blocks, block_size, Hkv, D] with equal layout."""
    # These three checks run per layer and step: plain ifs, so a message is formatted only when
    # a check fails (eager f-strings were ~50 us per decode-attention call).
    if k_cache.dim() != 4:
        raise ValueError(f"{name}: k_cache must be [num_blocks, block_size, Hkv, D], got shape "
                         f"{tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"{name}: v_cache shape {tuple(v_cache.shape)} != k_cache shape "
                         f"{tuple(k_cache.shape)}")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"{name}: v_cache dtype {v_cache.dtype} != k_cache dtype {k_cache.dtype}")
    if v_cache.device != k_cache.device:
        raise ValueError(f"{name}: v_cache on {v_cache.device} but k_cache on {k_cache.device}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError(f"{name}: the head_dim axis of the caches must have stride 1, got "
                         f"strides {k_cache.stride()} and {v_cache.stride()}")


def check_int_tensor(name: str, arg: str, t: torch.Tensor, dims: int, dtype: torch.dtype,
                     device: torch.device) -> None:
    if t.dim() != dims:
        raise ValueError(f"{name}: {arg} must have {dims} dims, got shape {tuple(t.shape)}")
    if t.dtype != dtype:
        raise ValueError(f"{name}: {arg} must be {dtype}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name}: {arg} is on {t.device} but the cache is on {device}")


def check_query(name: str, q: torch.Tensor, k_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """q is [N, Hq, D] matching the cache; returns (N, Hq, Hkv, D)."""
    if q.dim() != 3:
        raise ValueError(f"{name}: q must be [tokens, Hq, D], got shape {tuple(q.shape)}")
    n, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if head_dim != k_cache.shape[3]:
        raise ValueError(f"{name}: q head_dim {head_dim} != cache head_dim {k_cache.shape[3]}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{name}: Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}")
    check_storage(name, q.dtype, k_cache.dtype)
    if q.device != k_cache.device:
        raise ValueError(f"{name}: q on {q.device} but cache on {k_cache.device}")
    if q.stride(-1) != 1:
        raise ValueError(f"{name}: q's head_dim axis must have stride 1, got {q.stride()}")
    return n, num_q_heads, num_kv_heads, head_dim


def check_block_mapping(name: str, block_mapping: torch.Tensor) -> None:
    require(block_mapping.dim() == 2 and block_mapping.shape[1] == 2,
            f"{name}: block_mapping must be [N, 2] (src, dst), got shape {tuple(block_mapping.shape)}")
    require(block_mapping.dtype == torch.int64,
            f"{name}: block_mapping must be int64, got {block_mapping.dtype}")


LOG2E = 1.4426950408889634


def triton_dtype(dtype: torch.dtype):
    """The Triton element type of a torch float dtype (the query's: caches widen to it)."""
    import triton.language as tl
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 caches get exact fp32 dots; tf32 would cost ~1e-3 relative error.
    return "ieee" if dtype == torch.float32 else "tf32"


def check_triton_cache(name: str, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    block_size, head_dim = k_cache.shape[1], k_cache.shape[3]
    require(k_cache.stride() == v_cache.stride(),
            f"{name}: k_cache strides {k_cache.stride()} != v_cache strides {v_cache.stride()}")
    require(block_size >= 16 and block_size & (block_size - 1) == 0,
            f"{name}: the Triton kernel needs a power-of-two block_size >= 16, got {block_size}")
    require(head_dim >= 16, f"{name}: the Triton kernel needs head_dim >= 16, got {head_dim}")


# The most bytes of one K (or V) tile a Triton attention kernel loads at a time, in the query's
# dtype: K and V tiles and their dot operands go through shared memory (fp32, head_dim 256, 64
# tokens: ~150 KB on sm_90, of its 227 KB). Every tile of head sizes up to 128 fits as it is.
KV_TILE_BYTES = 64 * 1024


def kv_tile_tokens(tokens: int, block_d: int, element_bytes: int) -> int:
    """`tokens` (a power of two), halved until a [tokens, block_d] tile of elements of this size
    (the query's) fits KV_TILE_BYTES (at least 16: tl.dot's smallest)."""
    while tokens > 16 and tokens * block_d * element_bytes > KV_TILE_BYTES:
        tokens //= 2
    return tokens


def new_output(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """Allocate a kernel's output (uninitialized; tests swap this for a NaN-filled one)."""
    return torch.empty(shape, dtype=like.dtype, device=like.device)
