"""Copy whole blocks inside the device pool (copy-on-write): dst <- src, every layer, K and V.

The destinations must be distinct and must not appear as sources in the same call (the
scheduler's copy-on-write always targets freshly allocated blocks), so the copies commute.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_block_mapping, require
from .kv_format import raw


def _check_copy_blocks(kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    require(kv_cache.dim() == 6 and kv_cache.shape[1] == 2,
            f"copy_blocks: kv_cache must be [num_layers, 2, num_blocks, block_size, Hkv, D], "
            f"got shape {tuple(kv_cache.shape)}")
    check_block_mapping("copy_blocks", block_mapping)
    require(block_mapping.device == kv_cache.device,
            f"copy_blocks: block_mapping on {block_mapping.device} but kv_cache on {kv_cache.device}")


def copy_blocks_ref(kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Torch reference: kv_cache[:, :, dst] = kv_cache[:, :, src] for every (src, dst) row."""
    _check_copy_blocks(kv_cache, block_mapping)
    if block_mapping.shape[0] == 0:
        return
    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    kv_cache = raw(kv_cache)  # fp8 as bytes: CPU index_copy_ has no fp8 kernel
    kv_cache.index_copy_(2, dst, kv_cache.index_select(2, src))


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
