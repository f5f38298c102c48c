"""Write the new tokens' K and V into their cache slots.

Slot s is block s // block_size, offset s % block_size; slot -1 means "do not store" (padding
tokens, or tokens whose K/V another rank owns). A cache narrower than the model dtype (bf16 under
fp32, fp8: kernels/kv_format.py) gets the values converted, fp8 saturated to its range.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import require
from .kv_format import raw, to_storage
from .cache_ops_ref import (  # noqa: F401 (re-exported: the reference beside its kernel)
    _check_store_kv, store_kv_ref)


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cache_block, stride_cache_offset, stride_cache_head,
    block_size, num_kv_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program per token: copies its [Hkv, D] K and V tiles.
    token = tl.program_id(0)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    # The slot, broadcast over the head axis so the skip test is an ordinary tensor mask.
    # int64: block * stride may exceed 2**31.
    slot = tl.load(slot_ptr + token + heads * 0)
    mask = (heads < num_kv_heads) & (dims < head_dim) & (slot >= 0)
    block = slot // block_size
    offset = slot % block_size
    k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    dst = block * stride_cache_block + offset * stride_cache_offset + heads * stride_cache_head + dims
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kv_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Triton version of store_kv_ref (same signature, same effect). The dtype conversion runs
    in torch first; the kernel copies elements (fp8 as bytes)."""
    _check_store_kv(key, value, k_cache, v_cache, slot_mapping)
    require(k_cache.stride() == v_cache.stride(),
            f"store_kv: k_cache strides {k_cache.stride()} != v_cache strides {v_cache.stride()}")
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    key, value = raw(to_storage(key, k_cache.dtype)), raw(to_storage(value, v_cache.dtype))
    _store_kv_kernel[(num_tokens,)](
        key, value, raw(k_cache), raw(v_cache), slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_cache.shape[1], num_kv_heads, head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )
