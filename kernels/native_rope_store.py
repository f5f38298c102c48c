"""RoPE + KV cache store of one layer in one native call (kernels/native/rope_store.c).

`rope_store(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_q_heads, num_kv_heads)` takes the
fused q|k|v projection [T, (Hq + 2 Hkv) * D] (fp32 or bf16, CPU), returns the rotated queries
[T, Hq, D] in its dtype and stores the rotated keys and the values into their slots (slot -1: not
stored), like `RotaryEmbedding.apply` followed by `pagedserve.kernels.store_kv`. fp32 and bf16 caches; cos
and sin in qkv's dtype. The rotation runs in fp32 and rounds once (torch's bf16 ops round twice:
an ulp apart at most). `supports` says when it applies, and the model falls back to the torch ops
otherwise.
"""
from __future__ import annotations

import torch

from . import native
from ._prepared import prepared_call
from ._checks import check_cache_pair, check_int_tensor

FEATURE = "rope_store"
_FORMATS = {torch.float32: 0, torch.bfloat16: 1}


def unsupported_reason(device_type: str, dtype: torch.dtype,
                       cache_dtype: torch.dtype) -> str | None:
    """Why a model of `dtype` with a `cache_dtype` cache cannot take the native kernel; None when
    it can (CPU, fp32/bf16 model and cache, the library loaded)."""
    if device_type != "cpu":
        return f"{device_type} tensors"
    if dtype not in _FORMATS:
        return f"a {dtype} model (native: float32, bfloat16)"
    if cache_dtype not in _FORMATS:
        return f"a {cache_dtype} cache (native: float32, bfloat16)"
    if native.library(FEATURE) is None:
        return native.unavailable_reason(FEATURE)
    return None


def supports(qkv: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return (qkv.dim() == 2 and qkv.stride(1) == 1 and k_cache.device.type == qkv.device.type
            and unsupported_reason(qkv.device.type, qkv.dtype, k_cache.dtype) is None)


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_q_heads: int,
               num_kv_heads: int, threads: int | None = None,
               prepared: dict | None = None) -> torch.Tensor:
    """qkv [T, (Hq + 2 Hkv) * D] fp32 or bf16; cos/sin [T, D/2] (or [T, 1, D/2]) of its dtype;
    layer caches [num_blocks, block_size, Hkv, D] (fp32 or bf16); slot_mapping [T] int64 ->
    q [T, Hq, D] of qkv's dtype. `prepared`: a dict living as long as cos, sin and the slots (a
    step's attention metadata), where what every layer's call shares is kept."""
    if prepared is None:
        return RopeStoreCall(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_q_heads,
                             num_kv_heads, threads)(qkv, k_cache, v_cache)
    call = prepared_call(
        prepared, (cos, sin, slot_mapping), ("rope_store", num_q_heads, num_kv_heads, threads),
        (qkv, k_cache, v_cache), lambda: RopeStoreCall(qkv, cos, sin, k_cache, v_cache,
                                                       slot_mapping, num_q_heads, num_kv_heads,
                                                       threads))
    return call(qkv, k_cache, v_cache)


class RopeStoreCall:
    """rope_store's checks and arguments for one step, worked out once for every layer (which
    share cos/sin, the slots and the caches' shape); a layer's call passes its qkv and caches
    (one token: ~21 -> ~7 us a call, the kernel ~4)."""

    __slots__ = ("_fn", "_qkv_shape", "_qkv_dtype", "_qkv_row", "_cache_shape", "_cache_dtype",
                 "_cache_stride", "_q_shape", "_middle", "_tail", "_keep")

    def __init__(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 num_q_heads: int, num_kv_heads: int, threads: int | None = None) -> None:
        if not supports(qkv, k_cache):
            raise ValueError(
                f"rope_store: expected a 2-D fp32/bf16 CPU qkv with unit last stride and an "
                f"fp32/bf16 CPU cache, got qkv {qkv.dtype} {tuple(qkv.shape)} on {qkv.device}, "
                f"cache {k_cache.dtype} on {k_cache.device}"
                + ("" if native.library(FEATURE) is not None
                   else f" ({native.unavailable_reason(FEATURE)})"))
        check_cache_pair("rope_store", k_cache, v_cache)
        num_tokens = qkv.shape[0]
        num_blocks, block_size, cache_heads, head_dim = k_cache.shape
        if cache_heads != num_kv_heads or \
                qkv.shape[1] != (num_q_heads + 2 * num_kv_heads) * head_dim:
            raise ValueError(
                f"rope_store: qkv {tuple(qkv.shape)} does not hold {num_q_heads} + 2 x "
                f"{num_kv_heads} heads of {head_dim} for a cache of {cache_heads} kv heads")
        cos, sin = cos.reshape(num_tokens, -1), sin.reshape(num_tokens, -1)
        if not (cos.shape == sin.shape == (num_tokens, head_dim // 2) and cos.dtype == sin.dtype
                == qkv.dtype and cos.stride(1) == 1 and sin.stride() == cos.stride()):
            raise ValueError(
                f"rope_store: cos/sin must be {qkv.dtype} [T={num_tokens}, {head_dim // 2}] "
                f"rows, got {tuple(cos.shape)} {cos.dtype} and {tuple(sin.shape)} {sin.dtype}")
        check_int_tensor("rope_store", "slot_mapping", slot_mapping, 1, torch.int64,
                         k_cache.device)
        if slot_mapping.shape[0] != num_tokens:
            raise ValueError(f"rope_store: slot_mapping has {slot_mapping.shape[0]} slots for "
                             f"{num_tokens} tokens")
        if k_cache.stride() != v_cache.stride():
            raise ValueError(
                f"rope_store: k_cache and v_cache need equal strides, got {k_cache.stride()} "
                f"and {v_cache.stride()}")
        slots = slot_mapping.contiguous()
        self._keep = (cos, sin, slots)
        self._fn = native.library(FEATURE).rope_store
        self._qkv_shape, self._qkv_dtype, self._qkv_row = qkv.shape, qkv.dtype, qkv.stride(0)
        self._cache_shape, self._cache_dtype = k_cache.shape, k_cache.dtype
        self._cache_stride = k_cache.stride()
        self._q_shape = (num_tokens, num_q_heads, head_dim)
        self._middle = (num_q_heads, num_kv_heads, head_dim, cos.data_ptr(), sin.data_ptr(),
                        cos.stride(0))
        self._tail = (num_blocks * block_size, block_size, *self._cache_stride[:3],
                      slots.data_ptr(), _FORMATS[k_cache.dtype], threads or torch.get_num_threads())

    def fits(self, qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        return (qkv.shape == self._qkv_shape and qkv.dtype == self._qkv_dtype
                and qkv.stride(0) == self._qkv_row and qkv.stride(1) == 1
                and k_cache.shape == self._cache_shape == v_cache.shape
                and k_cache.dtype == self._cache_dtype == v_cache.dtype
                and k_cache.stride() == self._cache_stride == v_cache.stride())

    def __call__(self, qkv: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor) -> torch.Tensor:
        if not self.fits(qkv, k_cache, v_cache):
            raise ValueError(f"rope_store: the tensors do not match the call's preparation (qkv "
                             f"{tuple(qkv.shape)} {qkv.dtype}, cache {tuple(k_cache.shape)})")
        q = torch.empty(self._q_shape, dtype=self._qkv_dtype)
        status = self._fn(qkv.data_ptr(), _FORMATS[self._qkv_dtype], self._q_shape[0],
                          self._qkv_row, *self._middle, q.data_ptr(), k_cache.data_ptr(),
                          v_cache.data_ptr(), *self._tail)
        if status == -2:
            raise ValueError(f"rope_store: a slot in slot_mapping is past the cache's "
                             f"{self._tail[0]} slots")
        if status != 0:
            raise ValueError(f"rope_store: bad sizes (head_dim {self._q_shape[2]}, status "
                             f"{status})")
        return q
