"""Which kernel each op of a worker takes, and why: the choices themselves, in one place.

PackableLinear (workers/models/layers.py) packs its weight for the kernel `cpu_linear` names,
RMSNorm, SiLU-and-mul and RoPE + KV store ask `native_cpu_elementwise` and their wrapper's
`supports`, attention dispatches through kernels/__init__.py; `kernel_paths` reports the same
decisions, from the same predicates, for the worker's start-up line (workers/model_runner.py).
Settings come from pagedserve.envs; the cached choices are dropped when they change, or when a
test selects another native build variant.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from pagedserve import envs, kernels

from . import (native, native_decode_attention, native_elementwise, native_linear,
               native_linear_q8, native_rope_store)

LINEAR_F32 = "native linear_f32.c"
LINEAR_BF16 = "native linear_bf16.c"
LINEAR_Q8 = "native linear_q8.c"
LINEAR_GGUF = "native linear_gguf.c"
TRITON_QUANT = "triton quant_linear"
KEPT_QUANTIZED = ("gguf", "awq", "gptq")
ONEDNN = "oneDNN packed"
F_LINEAR = "torch F.linear"
TRITON = "triton"


class KernelPath(NamedTuple):
    kernel: str
    reason: str


@functools.cache
def bf16_prepack_supported() -> bool:
    """Whether this CPU's oneDNN can pack and multiply a bf16 weight (it needs AVX-512 BW/VL/DQ
    or AVX-NE-CONVERT; on plain AVX2 both the reorder and the product raise)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        weight = torch.ones(8, 8, dtype=torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        out = torch.ops.mkldnn._linear_pointwise(weight, packed, None, "none", [], "")
    except RuntimeError:
        return False
    return bool(torch.equal(out, F.linear(weight, weight)))


def _onednn(reason: str) -> KernelPath:
    if torch.backends.mkldnn.is_available():
        return KernelPath(ONEDNN, reason)
    return KernelPath(F_LINEAR, f"{reason}; torch has no oneDNN")


@functools.cache
def fp32_linear() -> KernelPath:
    """The kernel of fp32 CPU linears (measurements in PackableLinear's docstring)."""
    choice = envs.current().fp32_linear
    if choice == "onednn":
        return _onednn("PAGEDSERVE_FP32_LINEAR=onednn")
    if not native_linear.available():
        return _onednn(native.unavailable_reason(native_linear.FEATURE))
    if choice == "native":
        return KernelPath(LINEAR_F32, "PAGEDSERVE_FP32_LINEAR=native")
    capability = torch.backends.cpu.get_cpu_capability()
    if capability.startswith("AVX512"):
        # linear_f32.c's 8-lane vectors were never measured against oneDNN on these CPUs
        return _onednn(f"CPU with AVX-512, torch capability {capability}")
    return KernelPath(LINEAR_F32, f"CPU without AVX-512, torch capability {capability}")


@functools.cache
def bf16_linear() -> KernelPath:
    """The kernel of bf16 CPU linears: linear_bf16.c where oneDNN has no bf16 product (there
    torch emulates it: SmolLM2-135M's matmuls of one forward at M = 256 ran at 15-16 GFLOP/s on
    the 2-core AVX2 EPYC), oneDNN's packed product where it has one."""
    choice = envs.current().bf16_linear
    if choice == "torch":
        why = "PAGEDSERVE_BF16_LINEAR=torch"
    elif not native_linear.available():
        why = native.unavailable_reason(native_linear.FEATURE)
    elif choice == "native":
        return KernelPath(LINEAR_BF16, "PAGEDSERVE_BF16_LINEAR=native")
    elif not bf16_prepack_supported():
        return KernelPath(LINEAR_BF16, "oneDNN has no bf16 product on this CPU")
    else:
        why = "oneDNN has a bf16 product on this CPU"
    if bf16_prepack_supported():
        return KernelPath(ONEDNN, why)
    return KernelPath(F_LINEAR, f"{why}; oneDNN cannot pack bf16 here")


def cpu_linear(dtype: torch.dtype) -> KernelPath:
    """The kernel a CPU PackableLinear of `dtype` is packed for."""
    if not envs.current().prepack:
        return KernelPath(F_LINEAR, "PAGEDSERVE_PREPACK=0")
    if dtype == torch.float32:
        return fp32_linear()
    if dtype == torch.bfloat16:
        return bf16_linear()
    return KernelPath(F_LINEAR, f"no packed kernel for {dtype}")


def native_cpu_elementwise() -> bool:
    """Whether CPU RMSNorm, SiLU-and-mul and RoPE + KV store may take their native kernels
    (PAGEDSERVE_NATIVE_ELEMENTWISE, on by default); each also needs its own library loaded and
    inputs it supports (native_elementwise.supports, native_rope_store.supports). On the 2-core
    AVX2 EPYC, SmolLM2-135M fp32, batch 64 at context 511: the step's time outside the linears
    and attention fell from 25-39 ms to 19-27 ms with the first two; RoPE + store took the step
    from 244.4 to 232.5 ms (medians)."""
    return envs.current().native_elementwise


def clear_cache() -> None:
    """Drop the cached choices (settings or the native build variant changed; tests that patch
    what the host offers)."""
    fp32_linear.cache_clear()
    bf16_linear.cache_clear()


envs.on_change(clear_cache)
native.on_variant_change(clear_cache)


def _triton(device_type: str) -> KernelPath:
    backend = kernels.get_backend()
    return KernelPath(TRITON, "PAGEDSERVE_KERNELS=triton" if backend == "triton"
                      else f"{device_type} tensors")


def linear_path(device_type: str, dtype: torch.dtype) -> KernelPath:
    if device_type != "cpu":
        return KernelPath(F_LINEAR, f"{device_type} tensors")
    return cpu_linear(dtype)


def lm_head_path(device_type: str, dtype: torch.dtype, quantization: str,
                 in_features: int | None) -> KernelPath:
    if quantization in KEPT_QUANTIZED:
        return quantized_path(device_type, quantization)
    if quantization == "int8" and in_features is not None \
            and native_linear_q8.supports(in_features):
        return KernelPath(LINEAR_Q8, "--quantization int8")
    path = linear_path(device_type, dtype)
    # compute_logits multiplies an unpacked LM head with torch.mm into a reused buffer
    return KernelPath("torch.mm", path.reason) if path.kernel == F_LINEAR else path


def _vector_body(head_dim: int) -> str:
    if head_dim not in (64, 128, 256):
        return f"portable body: head_dim {head_dim}"
    lanes = native_decode_attention.vector_lanes()
    if head_dim == 256 and lanes != 16:     # paged_attention.h: MAX_VECTOR_D
        return f"portable body: head_dim {head_dim}"
    return {16: "AVX-512 body", 8: "AVX2 body"}.get(lanes, "portable body")


def decode_attention_path(device_type: str, dtype: torch.dtype, cache_dtype: torch.dtype,
                          head_dim: int) -> KernelPath:
    if kernels.triton_runs_on(device_type):
        return _triton(device_type)
    choice = envs.current().decode_cpu
    if choice != "native":
        kernel = {"bucketed": "bucketed torch", "ref": "torch reference"}[choice]
        return KernelPath(kernel, f"PAGEDSERVE_DECODE_CPU={choice}")
    why = native_decode_attention.unsupported_reason(device_type, dtype, cache_dtype, head_dim)
    if why is not None:
        return KernelPath("bucketed torch", why)
    return KernelPath(f"native ({_vector_body(head_dim)})", "PAGEDSERVE_DECODE_CPU=native")


def prefill_attention_path(device_type: str, dtype: torch.dtype, cache_dtype: torch.dtype,
                           head_dim: int) -> KernelPath:
    if kernels.triton_runs_on(device_type):
        return _triton(device_type)
    decode = decode_attention_path(device_type, dtype, cache_dtype, head_dim)
    if device_type == "cpu" and decode.kernel.startswith("native"):
        # workers/models/attention.attend: each prefill row is a decode query over its prefix
        return KernelPath(decode.kernel, "each prefill row as a decode query over its prefix")
    return KernelPath("torch reference (gather + SDPA)", decode.reason)


def elementwise_path(device_type: str, dtype: torch.dtype) -> KernelPath:
    if device_type != "cpu":
        why = f"{device_type} tensors"
    elif not native_cpu_elementwise():
        why = "PAGEDSERVE_NATIVE_ELEMENTWISE=0"
    elif dtype not in native_elementwise.DTYPES:
        why = f"a {dtype} model (native: float32, bfloat16)"
    elif not native_elementwise.available():
        why = native.unavailable_reason(native_elementwise.FEATURE)
    else:
        return KernelPath("native elementwise.c", "PAGEDSERVE_NATIVE_ELEMENTWISE=1")
    return KernelPath("torch", why)


def rope_store_path(device_type: str, dtype: torch.dtype, cache_dtype: torch.dtype) -> KernelPath:
    if device_type == "cpu" and not native_cpu_elementwise():
        why = "PAGEDSERVE_NATIVE_ELEMENTWISE=0"
    else:
        why = native_rope_store.unsupported_reason(device_type, dtype, cache_dtype)
    if why is None:
        return KernelPath("native rope_store.c", "PAGEDSERVE_NATIVE_ELEMENTWISE=1")
    store = "triton" if kernels.triton_runs_on(device_type) else "torch"
    return KernelPath(f"torch RoPE + {store} store_kv", why)


def quantized_path(device_type: str, quantization: str) -> KernelPath:
    """Linears whose weights stay in their checkpoint's block formats."""
    why = f"--quantization {quantization}: weights in their block formats"
    if device_type == "cpu":
        return KernelPath(LINEAR_GGUF, why)
    return KernelPath(TRITON_QUANT, why)


def int8_path(quantization: str) -> KernelPath:
    if quantization in KEPT_QUANTIZED:
        return KernelPath("off", f"--quantization {quantization}")
    if quantization != "int8":
        return KernelPath("off", f"--quantization {quantization}")
    return KernelPath(LINEAR_Q8, "--quantization int8, for linears whose in_features are whole "
                                 "blocks of 32; the others take the linear path")


def kernel_paths(device: torch.device | str, dtype: torch.dtype, quantization: str = "none",
                 kv_cache_dtype: torch.dtype | None = None, head_dim: int = 64,
                 hidden_size: int | None = None) -> dict[str, KernelPath]:
    """{op: (kernel, why)} for a worker of this device, model dtype, quantization and cache
    dtype (default: the model's); `hidden_size` is the LM head's in_features."""
    device_type = torch.device(device).type
    cache_dtype = kv_cache_dtype or dtype
    return {
        "linear": quantized_path(device_type, quantization) if quantization in KEPT_QUANTIZED
        else linear_path(device_type, dtype),
        "lm_head": lm_head_path(device_type, dtype, quantization, hidden_size),
        "decode attention": decode_attention_path(device_type, dtype, cache_dtype, head_dim),
        "prefill attention": prefill_attention_path(device_type, dtype, cache_dtype, head_dim),
        "rms_norm/silu": elementwise_path(device_type, dtype),
        "rope+kv store": rope_store_path(device_type, dtype, cache_dtype),
        "int8": int8_path(quantization),
    }


def describe(paths: dict[str, KernelPath]) -> str:
    """One line: `op -> kernel (why); ...`."""
    return "; ".join(f"{op} -> {path.kernel} ({path.reason})" for op, path in paths.items())
