"""Decode attention on CPU through the native kernel (kernels/native: paged_attention.h, and
decode_<format>.c for each cache format).

Same contract and numbers as paged_decode_attention_ref (fp32 softmax and accumulation), but
each sequence's pages are read once, straight from the block table, instead of being gathered
into a scratch buffer and read again by SDPA. Sequences longer than PART_TOKENS are split into up
to MAX_PARTS partitions that run as separate tasks (so that one sequence alone still uses every
thread) and are merged by log-sum-exp in order. A row's partitions follow from its own context
length, so its result does not depend on what else is in the batch.

Supports fp32, bf16 and fp8 (e4m3fn, e5m2) caches under fp32 or bf16 queries; the C kernel works in
fp32 (a bf16 query and its output are converted here, a few hundred KB per layer). `supports()`
says whether a call can run here, and kernels/__init__.py falls back to the torch path otherwise.
"""
from __future__ import annotations

import ctypes

import torch

from pagedserve import envs

from . import native
from .attention_ref import _check_decode

FEATURE = "decode_attention"
PART_TOKENS = 512  # the smallest partition a row is cut into (rounded to whole blocks)
MAX_PARTS = 4      # partitions a row is cut into at most
# Threads of the kernel's task pool, as set_threads set them; None: PAGEDSERVE_ATTENTION_THREADS,
# where 0 means torch's current thread count. A CPU worker sets it to its cores, which may exceed
# its torch threads: see kernels/native/task_pool.c.
_threads: int | None = None


def set_threads(count: int) -> None:
    """Threads for the native decode kernel (0: follow torch.get_num_threads())."""
    global _threads
    if count < 0:
        raise ValueError(f"attention threads must be >= 0, got {count}")
    _threads = count


def _thread_count() -> int:
    count = envs.current().attention_threads if _threads is None else _threads
    return count or torch.get_num_threads()


# by cache dtype; the query and output are fp32 in the C kernel
_FUNCTIONS = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16",
              torch.float8_e4m3fn: "paged_decode_e4m3", torch.float8_e5m2: "paged_decode_e5m2"}
_QUERY_DTYPES = (torch.float32, torch.bfloat16)
_ERRORS = {-1: "head_dim must be in 1..256", -2: "Hq must be a multiple of Hkv",
           -3: "the partition size must be a multiple of block_size",
           -4: "out of memory for the per-thread buffers",
           -5: "a context length is < 1 or longer than its block table row covers",
           -6: "a block table entry within a context is not a valid block id"}


def unsupported_reason(device_type: str, q_dtype: torch.dtype, cache_dtype: torch.dtype,
                       head_dim: int) -> str | None:
    """Why the native kernel cannot run a call of these kinds; None when it can (CPU tensors, an
    fp32/bf16 query, an fp32/bf16/fp8 cache, head_dim up to 256, the library loaded)."""
    if device_type != "cpu":
        return f"{device_type} tensors"
    if cache_dtype not in _FUNCTIONS:
        return f"a {cache_dtype} cache (native: float32, bfloat16, float8_e4m3fn, float8_e5m2)"
    if q_dtype not in _QUERY_DTYPES:
        return f"a {q_dtype} query (native: float32, bfloat16)"
    if head_dim > 256:
        return f"head_dim {head_dim} > 256"
    if native.library(FEATURE) is None:
        return native.unavailable_reason(FEATURE)
    return None


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the native kernel can run this call (see unsupported_reason)."""
    return unsupported_reason(q.device.type, q.dtype, k_cache.dtype, k_cache.shape[-1]) is None


def vector_lanes() -> int:
    """The lanes of the vector body the library was built with: 16 (AVX-512), 8 (AVX2 + FMA),
    0 (portable only). Head sizes other than 64 and 128 (and 256 with AVX-512), and GQA groups
    over 8, take the portable body."""
    lib = native.library(FEATURE)
    if lib is None:
        raise ValueError(f"native_decode_attention.vector_lanes: "
                         f"{native.unavailable_reason(FEATURE)}")
    return lib.paged_decode_vector_lanes()


def paged_decode_attention_native(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables: torch.Tensor, context_lens: torch.Tensor,
                                  scale: float, window: int = 0) -> torch.Tensor:
    """out[B, Hq, D]: each sequence's one query against its keys 0 .. context_lens[b] - 1, or
    with a window > 0 its last `window` of them (blocks before those are never read)."""
    return DecodeCall(q, k_cache, v_cache, block_tables, context_lens, window)(
        q, k_cache, v_cache, scale)


class DecodeCall:
    """One step's decode attention over given block tables, prepared once for every layer.

    The checks, the partition plan, a workspace of its own and the kernel's arguments depend on
    the tables, the query's shape and the caches' shape, which all layers of a step share; a
    layer's call then only passes its query and cache pointers (30 layers of SmolLM2 at one
    sequence: ~75 -> ~30 us a call). `fits` says whether a call's tensors match the preparation.
    """

    __slots__ = ("_fn", "_q_shape", "_cache_shape", "_cache_stride", "_cache_dtype", "_q_dtype",
                 "_middle", "_tail", "_tables", "_lens", "_workspace")

    def __init__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, window: int = 0) -> None:
        num_seqs, num_q_heads, num_kv_heads, head_dim = _check_decode(q, k_cache, v_cache,
                                                                      block_tables, context_lens)
        if k_cache.dtype not in _FUNCTIONS:
            raise ValueError(f"paged_decode_attention_native: cache dtype {k_cache.dtype} is not "
                             f"supported (float32, bfloat16, float8_e4m3fn or float8_e5m2)")
        if q.dtype not in _QUERY_DTYPES:
            raise ValueError(f"paged_decode_attention_native: query dtype {q.dtype} is not "
                             f"supported (float32 or bfloat16)")
        if k_cache.stride() != v_cache.stride():
            raise ValueError(f"paged_decode_attention_native: k_cache strides {k_cache.stride()} "
                             f"!= v_cache strides {v_cache.stride()}")
        lib = native.library(FEATURE)
        if lib is None:
            raise ValueError(f"paged_decode_attention_native: "
                             f"{native.unavailable_reason(FEATURE)}")
        self._fn = getattr(lib, _FUNCTIONS[k_cache.dtype])
        self._q_shape, self._q_dtype = q.shape, q.dtype
        self._cache_shape, self._cache_dtype = k_cache.shape, k_cache.dtype
        self._cache_stride = k_cache.stride()
        self._tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
        self._lens = context_lens.contiguous()
        block_size = k_cache.shape[1]
        threads = _thread_count()
        max_context = int(self._lens.max()) if num_seqs else 0
        if window > 0:      # the keys a task walks start at the block of the window's first
            max_context = min(max_context, window + block_size - 1)
        # Each row's partitions depend on its own context alone (batch invariance: the same
        # bits decoding alone, beside others, or as a row of a multi-token step, e.g.
        # speculative drafts): the kernel cuts a row into at most MAX_PARTS partitions of at
        # least PART_TOKENS (whole blocks), so one short sequence still uses every thread and a
        # long batch does not pay for many small partitions.
        part_tokens = max(1, PART_TOKENS // block_size) * block_size
        max_parts = max(min(MAX_PARTS, -(-max_context // part_tokens)), 1)
        self._workspace = torch.empty((num_seqs * max_parts * num_q_heads * (head_dim + 2),),
                                      dtype=torch.float32)
        self._middle = (self._cache_stride[0], self._cache_stride[1], self._cache_stride[2],
                        k_cache.shape[0], self._tables.data_ptr(), self._tables.stride(0),
                        self._tables.shape[1], self._lens.data_ptr(), num_seqs, num_q_heads,
                        num_kv_heads, head_dim, block_size)
        self._tail = (max(window, 0), part_tokens, max_parts, self._workspace.data_ptr(), threads)

    def fits(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        return (q.shape == self._q_shape and q.dtype == self._q_dtype
                and k_cache.shape == self._cache_shape and k_cache.dtype == self._cache_dtype
                and k_cache.stride() == self._cache_stride == v_cache.stride()
                and v_cache.shape == self._cache_shape and v_cache.dtype == self._cache_dtype)

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 scale: float) -> torch.Tensor:
        if not self.fits(q, k_cache, v_cache):  # kernels.paged_decode_attention asked fits first
            raise ValueError("paged_decode_attention_native: the tensors do not match the call's "
                             f"preparation (q {tuple(q.shape)} {q.dtype}, cache "
                             f"{tuple(k_cache.shape)} {k_cache.dtype})")
        out = torch.empty(self._q_shape, dtype=torch.float32)
        if self._q_shape[0] == 0:
            return out.to(self._q_dtype)
        query = q.to(torch.float32).contiguous()
        status = self._fn(query.data_ptr(), out.data_ptr(), k_cache.data_ptr(),
                          v_cache.data_ptr(), *self._middle, ctypes.c_float(scale), *self._tail)
        if status != 0:
            raise ValueError(f"paged_decode_attention_native: {_ERRORS.get(status, status)}")
        return out if self._q_dtype == torch.float32 else out.to(self._q_dtype)
