"""The torch references of the cache kernels, with their checks: store_kv (new tokens' K/V into
their slots, triton_store_kv.py) and copy_blocks (copy-on-write inside the device pool,
triton_copy_blocks.py). A CPU worker runs these (or the native kernels) and never imports Triton."""
from __future__ import annotations

import torch

from ._checks import check_block_mapping, check_cache_pair, check_int_tensor, require
from .kv_format import check_storage, raw, to_storage


def _check_store_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    check_cache_pair("store_kv", k_cache, v_cache)
    require(key.dim() == 3 and key.shape[1:] == k_cache.shape[2:],
            f"store_kv: key must be [T, Hkv={k_cache.shape[2]}, D={k_cache.shape[3]}], "
            f"got {tuple(key.shape)}")
    require(value.shape == key.shape,
            f"store_kv: value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    require(value.dtype == key.dtype,
            f"store_kv: value dtype {value.dtype} != key dtype {key.dtype}")
    check_storage("store_kv", key.dtype, k_cache.dtype)
    require(key.stride(-1) == 1 and value.stride(-1) == 1,
            f"store_kv: key/value head_dim axis must have stride 1, got {key.stride()}, {value.stride()}")
    check_int_tensor("store_kv", "slot_mapping", slot_mapping, 1, torch.int64, k_cache.device)
    require(slot_mapping.shape[0] == key.shape[0],
            f"store_kv: slot_mapping has {slot_mapping.shape[0]} slots for {key.shape[0]} tokens")


def store_kv_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Torch reference: k_cache/v_cache[slot] = key/value[t] for every t with slot >= 0."""
    _check_store_kv(key, value, k_cache, v_cache, slot_mapping)
    num_blocks, block_size = k_cache.shape[:2]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
    # Flattening [num_blocks, block_size] into slots needs those two axes to be mergeable,
    # which holds for layer views of the contract's kv_cache (inner axes contiguous).
    k_slots = raw(k_cache).view(num_blocks * block_size, *k_cache.shape[2:])
    v_slots = raw(v_cache).view(num_blocks * block_size, *v_cache.shape[2:])
    k_slots.index_copy_(0, slot_mapping, raw(to_storage(key, k_cache.dtype)))
    v_slots.index_copy_(0, slot_mapping, raw(to_storage(value, v_cache.dtype)))


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
