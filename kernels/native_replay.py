"""A recorded list of native kernel calls, replayed in one ctypes call (kernels/native/replay.c).

`Program` records calls of the native kernels by kind, with every argument worked out once
(pointers into buffers that outlive the program, sizes, thread counts); `run()` makes them all
in order. A CPU decode step of a small model is ~300 kernel calls whose Python wrappers (checks,
fresh outputs, ctypes conversions) cost more than the kernels (workers/cpu_decode_replay.py
records one step per batch size). The caller owns correctness of the recorded arguments: the
kernels still check their sizes and slots and return a status, which `run` raises with the op's
name.
"""
from __future__ import annotations

import ctypes
import struct

import numpy as np

from . import native

FEATURE = "replay"
OP_WORDS = 32                       # kernels/native/replay.c: kind, function, 30 arguments
OP_KINDS = 16                       # replay.c: the per-kind time sums a timed run fills

# op kinds (replay.c's enum): kind -> (feature, kernel name), the address recorded for it
RMS_NORM, SILU_MUL, GGUF_LINEAR, GGUF_PACKED, LINEAR_F32, LINEAR_Q8, ROPE_STORE, DECODE, \
    ADD_ROWS = range(1, 10)
KERNELS = {RMS_NORM: ("elementwise", "rms_norm_f32"), SILU_MUL: ("elementwise", "silu_mul_f32"),
           GGUF_LINEAR: ("linear_gguf", "gguf_linear"),
           GGUF_PACKED: ("linear_gguf", "gguf_packed_linear"),
           LINEAR_F32: ("linear", "linear_f32"), LINEAR_Q8: ("linear_q8", "linear_q8"),
           ROPE_STORE: ("rope_store", "rope_store")}
DECODE_KERNELS = {"float32": "paged_decode_f32", "bfloat16": "paged_decode_bf16",
                  "float8_e4m3fn": "paged_decode_e4m3", "float8_e5m2": "paged_decode_e5m2"}
# the argument count of each kind (replay.c's casts)
ARITY = {RMS_NORM: 11, SILU_MUL: 7, GGUF_LINEAR: 11, GGUF_PACKED: 10, LINEAR_F32: 9,
         LINEAR_Q8: 10, ROPE_STORE: 21, DECODE: 23, ADD_ROWS: 5}


class F32(float):
    """A float argument: recorded as the bits of its fp32 value."""


def available() -> bool:
    return native.library(FEATURE) is not None


def address(feature: str, name: str) -> int:
    """The address of kernel `name` in `feature`'s library (ValueError if it does not load)."""
    lib = native.library(feature)
    if lib is None:
        raise ValueError(f"native_replay: {native.unavailable_reason(feature)}")
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


def _word(value) -> int:
    if isinstance(value, F32):
        return struct.unpack("<I", struct.pack("<f", value))[0]
    if value is None:
        return 0
    return int(value)


class Program:
    """Kernel calls in order; `add` records one, `run` replays them all."""

    def __init__(self) -> None:
        self._rows: list[list[int]] = []
        self.names: list[str] = []
        self._ops: np.ndarray | None = None
        self._failed = ctypes.c_int64(-1)

    def add(self, kind: int, name: str, *args, fn: int | None = None) -> int:
        """Record kernel `kind` called with `args` (its C order); `name` says what the call is
        in errors. `fn`: the address (the decode kernel's, which depends on the cache format);
        by default the kind's kernel. Returns the op's index."""
        if kind not in ARITY:
            raise ValueError(f"native_replay: unknown op kind {kind}")
        if len(args) != ARITY[kind]:
            raise ValueError(f"native_replay: {name}: op kind {kind} takes {ARITY[kind]} "
                             f"arguments, got {len(args)}")
        if fn is None:
            fn = 0 if kind == ADD_ROWS else address(*KERNELS[kind])
        row = [kind, fn, *(_word(a) for a in args)]
        self._rows.append(row + [0] * (OP_WORDS - len(row)))
        self.names.append(name)
        self._ops = None
        return len(self._rows) - 1

    @property
    def ops(self) -> np.ndarray:
        """The recorded ops, int64 [count, OP_WORDS]; writable, so that a caller can change an
        argument between runs (`set_arg`)."""
        if self._ops is None:
            self._ops = np.array(self._rows, dtype=np.int64).reshape(-1, OP_WORDS)
        return self._ops

    def set_arg(self, ops: list[int] | np.ndarray, index: int, value: int) -> None:
        """Argument `index` of ops `ops` becomes `value` (an integer) for the next runs."""
        self.ops[ops, 2 + index] = value

    def __len__(self) -> int:
        return len(self._rows)

    def run(self, seconds: np.ndarray | None = None) -> None:
        """Make every recorded call in order. `seconds` (float64 [OP_KINDS]): each op's wall
        time is added to seconds[kind] (step traces)."""
        ops = self.ops
        if not len(ops):
            return
        lib = native.library(FEATURE)
        if lib is None:
            raise ValueError(f"native_replay: {native.unavailable_reason(FEATURE)}")
        if seconds is not None and not (seconds.dtype == np.float64 and seconds.shape == (OP_KINDS,)
                                        and seconds.flags.c_contiguous):
            raise ValueError(f"native_replay: seconds must be float64 [{OP_KINDS}]")
        status = lib.replay_ops(ops.ctypes.data, len(ops), ctypes.byref(self._failed),
                                None if seconds is None else seconds.ctypes.data)
        if status != 0:
            index = self._failed.value
            raise RuntimeError(f"native_replay: op {index} ({self.names[index]}) returned "
                               f"status {status}")
