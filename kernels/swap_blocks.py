"""Move whole blocks between the device pool and the host swap pool (swap out / swap in).

Both pools have the contract's layout [num_layers, 2, num_blocks, block_size, Hkv, D] and differ
only in num_blocks and device. This is a torch index copy on either side: the data crosses the
bus once, as one gathered tensor, so no Triton kernel is needed.
"""
from __future__ import annotations

import torch

from ._checks import check_block_mapping, require
from .kv_format import raw


def _check_swap_blocks(src_cache, dst_cache, block_mapping) -> None:
    require(src_cache.dim() == 6 and src_cache.shape[1] == 2,
            f"swap_blocks: src_cache must be [num_layers, 2, num_blocks, block_size, Hkv, D], "
            f"got shape {tuple(src_cache.shape)}")
    require(dst_cache.dim() == 6 and src_cache.shape[:2] == dst_cache.shape[:2]
            and src_cache.shape[3:] == dst_cache.shape[3:],
            f"swap_blocks: dst_cache shape {tuple(dst_cache.shape)} does not match src_cache "
            f"{tuple(src_cache.shape)} outside the num_blocks axis")
    require(src_cache.dtype == dst_cache.dtype,
            f"swap_blocks: src dtype {src_cache.dtype} != dst dtype {dst_cache.dtype}")
    check_block_mapping("swap_blocks", block_mapping)


def swap_blocks_ref(src_cache: torch.Tensor, dst_cache: torch.Tensor,
                    block_mapping: torch.Tensor) -> None:
    """dst_cache[:, :, dst] = src_cache[:, :, src] for every (src, dst) row, across devices.

    Gathers on the source side, moves one tensor, scatters on the destination side. Host to
    device goes through pinned memory and returns without waiting (stream-ordered before any
    later kernel); device to host waits, since the host side reads the data right away.
    """
    _check_swap_blocks(src_cache, dst_cache, block_mapping)
    if block_mapping.shape[0] == 0:
        return
    mapping = block_mapping.cpu()
    src = mapping[:, 0].to(src_cache.device, non_blocking=True)
    dst = mapping[:, 1].to(dst_cache.device, non_blocking=True)
    src_cache, dst_cache = raw(src_cache), raw(dst_cache)  # fp8 as bytes (no CPU fp8 index_copy_)
    blocks = src_cache.index_select(2, src)
    if blocks.device != dst_cache.device:
        to_device = dst_cache.device.type == "cuda"
        if to_device:
            blocks = blocks.pin_memory()
        blocks = blocks.to(dst_cache.device, non_blocking=to_device)
    dst_cache.index_copy_(2, dst, blocks)

