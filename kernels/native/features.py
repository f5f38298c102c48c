"""The native kernels as separate features: the C sources of each, and the ctypes signature of
every function its library exports.

Each feature is compiled into a library of its own (with its own copy of task_pool.c, which every
kernel runs its tasks on), so that a source that fails to compile, or a library that fails to
load, takes only its own feature off the native path. The signature tables are what ctypes calls
with: tests/kernels/test_native_signatures.py holds them to the C definitions, parameter by
parameter, and every exported function to an entry here.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

P, I32, I64, F32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float

TASK_POOL = "task_pool.c"


@dataclass(frozen=True, slots=True)
class Feature:
    name: str
    sources: tuple[str, ...]     # its own translation units; TASK_POOL is linked into each
    # exported function -> (restype, argtypes), as declared in the C sources
    signatures: dict[str, tuple[type | None, tuple[type, ...]]]

    @property
    def all_sources(self) -> tuple[str, ...]:
        return self.sources + (TASK_POOL,)


_DECODE_ARGS = (P, P, P, P, I64, I64, I64, I64, P, I64, I64, P, I32, I32, I32, I32, I32, F32, I32,
                I32, I32, P, I32)
_NORM_ARGS = (P, I64, P, I64, P, F32, I64, I64, P, I64, I32)
_SILU_ARGS = (P, I64, I64, I64, P, I64, I32)

DECODE_ATTENTION = Feature(
    "decode_attention", ("decode_f32.c", "decode_bf16.c", "decode_e4m3.c", "decode_e5m2.c"),
    {"paged_decode_f32": (I32, _DECODE_ARGS), "paged_decode_bf16": (I32, _DECODE_ARGS),
     "paged_decode_e4m3": (I32, _DECODE_ARGS), "paged_decode_e5m2": (I32, _DECODE_ARGS),
     "paged_decode_vector_lanes": (I32, ())})

LINEAR = Feature(
    "linear", ("linear_f32.c", "linear_bf16.c"),
    {"linear_pack_f32": (None, (P, I64, I64, I64, P)),
     "linear_f32": (I32, (P, I64, I64, I64, P, I64, P, I64, I32)),
     "linear_pack_bf16": (None, (P, I64, I64, I64, P)),
     "linear_bf16": (I32, (P, I64, I64, I64, P, I64, P, I64, P, I32))})

LINEAR_Q8 = Feature(
    "linear_q8", ("linear_q8.c",),
    {"linear_q8": (I32, (P, I64, I64, I64, P, P, I64, P, I64, I32)),
     "quantize_rows_q8": (I32, (P, I64, I64, I64, P, P))})

LINEAR_GGUF = Feature(
    "linear_gguf", ("linear_gguf.c",),
    {"gguf_linear": (I32, (I32, P, I64, I64, I64, P, I64, I64, P, I64, I32)),
     "gguf_quantize_rows": (I32, (P, I64, I64, I64, I32, P, P, P)),
     "gguf_dequantize_rows": (I32, (I32, P, I64, I64, I64, P, I64, P)),
     "gguf_packed_supported": (I32, ()),
     "gguf_packed_bytes": (I64, (I32, I64, I64)),
     "gguf_pack": (I32, (I32, P, I64, I64, I64, P)),
     "gguf_unpack_packed": (I32, (I32, P, I64, I64, P, I64, P, I64)),
     "gguf_packed_linear": (I32, (I32, P, I64, I64, P, I64, I64, P, I64, I32))})

ELEMENTWISE = Feature(
    "elementwise", ("elementwise.c",),
    {"rms_norm_f32": (I32, _NORM_ARGS), "rms_norm_bf16": (I32, _NORM_ARGS),
     "silu_mul_f32": (I32, _SILU_ARGS), "silu_mul_bf16": (I32, _SILU_ARGS)})

ROPE_STORE = Feature(
    "rope_store", ("rope_store.c",),
    {"rope_store": (I32, (P, I32, I64, I64, I32, I32, I32, P, P, I64, P, P, P, I64, I32, I64, I64,
                          I64, P, I32, I32))})

_LORA_ARGS = (P, I64, I64, P, P, P, I64, P, I64, I64, P, I64, I32)
LORA = Feature("lora", ("lora.c",), {"lora_shrink_f32": (I32, _LORA_ARGS),
                                     "lora_expand_f32": (I32, _LORA_ARGS)})

# The sampler's candidates: each row's k largest values and their indices (topk.c).
TOPK = Feature("topk", ("topk.c",), {"topk_f32": (I32, (P, I64, I64, I64, I64, P, P, I32)),
                                     "topk_max_k": (I32, ())})

# Replays a recorded list of the kernels above, called by their addresses (native_replay.py).
REPLAY = Feature("replay", ("replay.c",), {"replay_ops": (I32, (P, I64, P, P))})

FEATURES: dict[str, Feature] = {feature.name: feature for feature in (
    DECODE_ATTENTION, LINEAR, LINEAR_Q8, LINEAR_GGUF, ELEMENTWISE, ROPE_STORE, REPLAY, LORA, TOPK)}
