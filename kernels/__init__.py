"""Paged-KV-cache kernels: Triton on CUDA tensors, their torch references otherwise.

KV cache layout (docs/INTERFACES.md): kv_cache[num_layers, 2, num_blocks, block_size, Hkv, D],
index 0 = K, 1 = V; the attention kernels and store_kv take the layer views kv_cache[l, 0] and
kv_cache[l, 1]. Each kernels/triton_<name>.py holds a Triton kernel and its wrapper <name>_triton;
the torch reference <name>_ref of the same signature lives in attention_ref.py or
cache_ops_ref.py (and is re-exported beside its kernel), so that CPU processes, which run the
references and the native kernels, never import Triton (~100 MB of a worker's RSS); the
Triton modules are imported on the first call that runs one.

Backend choice: PAGEDSERVE_KERNELS=auto (default: Triton for CUDA tensors, torch otherwise),
=triton (always Triton: with TRITON_INTERPRET=1 this runs the kernels on CPU, for tests) or
=torch (always the torch paths); set_backend() overrides it.
On the torch backend, PAGEDSERVE_DECODE_CPU picks the decode attention for CPU tensors:
=native (default) runs the C kernel of kernels/native (built on first use with the system C
compiler; each sequence's pages are streamed once from the block table, no gather), falling back
to =bucketed when it cannot run (no compiler, an fp16 cache); =bucketed runs
paged_decode_attention_cpu (the reference's gather + SDPA with sequences bucketed by context
length); =ref runs paged_decode_attention_ref. Both settings come from pagedserve.envs, read at
the first kernel call; kernels/paths.py reports the path each op takes and why.
"""
from __future__ import annotations

import importlib
import warnings

import torch

from pagedserve import envs

from . import attention_ref as _attention_ref
from . import cache_ops_ref as _cache_ops_ref
from . import cpu_decode_attention as _cpu_decode
from . import native_decode_attention as _native_decode
from ._prepared import prepared_call
from .swap_blocks import swap_blocks_ref

BACKENDS = envs.KERNEL_BACKENDS
_backend: str | None = None      # set_backend's choice; None: PAGEDSERVE_KERNELS


def set_backend(name: str | None) -> None:
    """Select the kernel backend: "auto", "triton" or "torch"; None: PAGEDSERVE_KERNELS again."""
    global _backend
    if name is not None and name not in BACKENDS:
        raise ValueError(f"PAGEDSERVE_KERNELS={name!r}: expected one of {', '.join(BACKENDS)}")
    _backend = name


def get_backend() -> str:
    return envs.current().kernels if _backend is None else _backend


def triton_runs_on(device_type: str) -> bool:
    """Whether kernels called on tensors of this device type run the Triton version."""
    backend = get_backend()
    return backend == "triton" or (backend == "auto" and device_type == "cuda")


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether a kernel called on `tensor` runs the Triton version."""
    return triton_runs_on(tensor.device.type)


_native_warned = False


def _decode_native(q, k_cache, v_cache, block_tables, context_lens, scale, window=0):
    """The native CPU kernel where it can run, else the bucketed torch path (warned once)."""
    global _native_warned
    if _native_decode.supports(q, k_cache):
        return _native_decode.paged_decode_attention_native(q, k_cache, v_cache, block_tables,
                                                            context_lens, scale, window)
    reason = _native_decode.native.unavailable_reason(_native_decode.FEATURE)
    if reason and not _native_warned:
        _native_warned = True
        warnings.warn(f"{reason}; decode attention falls back to the torch path",
                      RuntimeWarning, stacklevel=3)
    return _cpu_decode.paged_decode_attention_cpu(q, k_cache, v_cache, block_tables,
                                                  context_lens, scale, window)


# PAGEDSERVE_DECODE_CPU -> the decode attention of tensors that do not take Triton
_DECODE_CPU = {"native": _decode_native, "bucketed": _cpu_decode.paged_decode_attention_cpu,
               "ref": _attention_ref.paged_decode_attention_ref}


def cpu_decode_kernel():
    """The decode attention PAGEDSERVE_DECODE_CPU selects for tensors that do not take Triton."""
    return _DECODE_CPU[envs.current().decode_cpu]


def native_decode_rows(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether CPU decode attention of q over k_cache runs on the native kernel (the default
    PAGEDSERVE_DECODE_CPU=native, and a build and dtypes it supports)."""
    return (envs.current().decode_cpu == "native" and not use_triton(q)
            and _native_decode.supports(q, k_cache))


# The Triton wrappers are looked up on their modules at call time (not bound at import): the
# modules (and Triton) load on first use, and tests can reload one under TRITON_INTERPRET=1.
def _triton(module: str):
    return importlib.import_module(f"{__name__}.{module}")


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k_cache/v_cache[slot_mapping[t]] = key/value[t], in place; slot -1 is skipped."""
    if use_triton(k_cache):
        kernel = _triton("triton_store_kv").store_kv_triton
        return kernel(key, value, k_cache, v_cache, slot_mapping)
    return _cache_ops_ref.store_kv_ref(key, value, k_cache, v_cache, slot_mapping)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float, window: int = 0,
                           prepared: dict | None = None) -> torch.Tensor:
    """out[B, Hq, D]: each sequence's one query against its keys 0 .. context_lens[b] - 1; with a
    sliding window > 0 only the last `window` of them (blocks before those are never read).
    `prepared`: a dict that lives as long as these block tables (a step's attention metadata):
    the native kernel keeps there what every layer's call over them shares."""
    if use_triton(q):
        kernel = _triton("triton_decode_attention").paged_decode_attention_triton
        return kernel(q, k_cache, v_cache, block_tables, context_lens, scale, window)
    kernel = cpu_decode_kernel()
    if prepared is not None and kernel is _decode_native:
        call = prepared_call(
            prepared, (block_tables, context_lens), ("decode", window), (q, k_cache, v_cache),
            lambda: _native_decode.DecodeCall(q, k_cache, v_cache, block_tables, context_lens,
                                              window) if _native_decode.supports(q, k_cache)
            else None)
        if call is not None:
            return call(q, k_cache, v_cache, scale)
    return kernel(q, k_cache, v_cache, block_tables, context_lens, scale, window)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            context_lens: torch.Tensor, scale: float,
                            window: int = 0) -> torch.Tensor:
    """out[T, Hq, D]: each sequence's query chunk, causally, against its cached prefix + itself;
    with a sliding window > 0 a row at position p sees keys p - window < j <= p only."""
    if use_triton(q):
        kernel = _triton("triton_prefill_attention").paged_prefill_attention_triton
    else:
        kernel = _attention_ref.paged_prefill_attention_ref
    return kernel(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, window)


def copy_blocks(kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """kv_cache[:, :, dst] = kv_cache[:, :, src] for every (src, dst) row of block_mapping."""
    if use_triton(kv_cache):
        return _triton("triton_copy_blocks").copy_blocks_triton(kv_cache, block_mapping)
    return _cache_ops_ref.copy_blocks_ref(kv_cache, block_mapping)


def swap_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor,
                block_mapping: torch.Tensor) -> None:
    """dst_cache[:, :, dst] = src_cache[:, :, src], between the device and the host pool."""
    return swap_blocks_ref(src_cache, dst_cache, block_mapping)


__all__ = ["store_kv", "paged_decode_attention", "native_decode_rows", "paged_prefill_attention",
           "copy_blocks", "swap_blocks", "set_backend", "get_backend", "use_triton",
           "triton_runs_on", "cpu_decode_kernel"]
