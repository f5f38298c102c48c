"""Copy whole blocks inside the device pool (copy-on-write): dst <- src, every layer, K and V.

The destinations must be distinct and must not appear as sources in the same call (the
scheduler's copy-on-write always targets freshly allocated blocks), so the copies commute.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import require
from .kv_format import raw
from .cache_ops_ref import (  # noqa: F401 (re-exported: the reference beside its kernel)
    _check_copy_blocks, copy_blocks_ref)


@triton.jit
def _copy_blocks_kernel(
    cache_ptr, mapping_ptr, stride_plane, stride_block, block_numel,
    CHUNK: tl.constexpr,
):
    # Program (pair, plane, chunk) copies CHUNK elements of one block of one (layer, K|V) plane.
    pair = tl.program_id(0)
    plane = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(2)
    src = tl.load(mapping_ptr + 2 * pair)
    dst = tl.load(mapping_ptr + 2 * pair + 1)
    offsets = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offsets < block_numel
    base = cache_ptr + plane * stride_plane
    values = tl.load(base + src * stride_block + offsets, mask=mask)
    tl.store(base + dst * stride_block + offsets, values, mask=mask)


def copy_blocks_triton(kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Triton version of copy_blocks_ref (same signature, same effect)."""
    _check_copy_blocks(kv_cache, block_mapping)
    require(kv_cache.is_contiguous(), "copy_blocks: the Triton kernel needs a contiguous kv_cache")
    require(block_mapping.is_contiguous(), "copy_blocks: block_mapping must be contiguous")
    num_pairs = block_mapping.shape[0]
    if num_pairs == 0:
        return
    num_layers, _, num_blocks = kv_cache.shape[:3]
    block_numel = kv_cache[0, 0, 0].numel()
    chunk = min(4096, triton.next_power_of_2(block_numel))
    grid = (num_pairs, num_layers * 2, triton.cdiv(block_numel, chunk))
    _copy_blocks_kernel[grid](raw(kv_cache), block_mapping, kv_cache.stride(1), kv_cache.stride(2),
                              block_numel, CHUNK=chunk)
