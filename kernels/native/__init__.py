"""Native CPU kernels: C sources here, compiled on first use with the system C compiler, called
through ctypes (which releases the GIL for the call).

The shared library is cached under <cache>/kernels/<key>/ (<cache> = $PAGEDSERVE_CACHE or
~/.cache/pagedserve), keyed by the source, the compiler and its flags, and the CPU's feature
flags (-march=native): a second process or a restarted worker loads it in milliseconds, and a
machine with other CPU features builds its own. Concurrent builders (tensor-parallel ranks
starting together) serialize on a file lock; the library is renamed into place atomically.

`library()` returns the loaded ctypes library, or None when it cannot be built (no compiler, a
compile error): the reason is in `unavailable_reason()` and callers fall back to the torch path.
"""
from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

# One translation unit per KV cache format (compiled in parallel) plus the task pool, the fp32
# and bf16 linears (one panel GEMM), the int8 linear (--quantization int8), the fp32 and bf16
# elementwise ops (RMSNorm, SiLU * up) and RoPE + KV store; the headers hold the kernel bodies
# they instantiate.
_SOURCES = ("decode_f32.c", "decode_bf16.c", "decode_e4m3.c", "decode_e5m2.c", "task_pool.c",
            "linear_f32.c", "linear_bf16.c", "linear_q8.c", "elementwise.c", "rope_store.c")
_HEADERS = ("paged_attention.h", "vec8.h", "linear_panels.h")
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-pthread", "-fPIC",
          "-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros")

_library: ctypes.CDLL | None = None
_reason: str | None = None
_loaded = False


def _cache_root() -> Path:
    return Path(os.environ.get("PAGEDSERVE_CACHE") or Path.home() / ".cache" / "pagedserve")


def _cpu_flags_line() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def cpu_flags() -> set[str]:
    """This CPU's feature flags (avx2, avx512f, amx_bf16, ...; empty where /proc/cpuinfo has
    none): what -march=native builds for, and what other CPU choices go by."""
    line = _cpu_flags_line()
    return set(line.split(":", 1)[1].split()) if ":" in line else set()


def _flags() -> tuple[str, ...]:
    """The compiler flags: _FLAGS, then $PAGEDSERVE_NATIVE_CFLAGS (tests build the AVX2 and the
    portable variants on an AVX-512 CPU with -mno-avx512f, -mno-avx2 ...)."""
    return _FLAGS + tuple(os.environ.get("PAGEDSERVE_NATIVE_CFLAGS", "").split())


def _build_key(compiler: str, source: bytes) -> str:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    digest = hashlib.sha256()
    for part in (source, " ".join(_flags()).encode(), version.encode(), _cpu_flags_line().encode(),
                 platform.machine().encode()):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:20]


def _compile(compiler: str, sources: list[Path], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            objects = [Path(tmp) / (src.stem + ".o") for src in sources]
            jobs = [subprocess.Popen([compiler, *_flags(), "-c", "-o", str(obj), str(src)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                    for src, obj in zip(sources, objects)]
            failures = []
            for job in jobs:
                try:
                    _, err = job.communicate(timeout=300)
                except subprocess.TimeoutExpired:
                    job.kill()
                    _, err = job.communicate()
                    err = f"timed out after 300 s\n{err}"
                if job.returncode != 0:
                    failures.append(err.strip())
            if failures:
                raise RuntimeError(f"{compiler} failed: {failures[0][-2000:]}")
            result = subprocess.run([compiler, *_flags(), "-shared", "-o", str(built),
                                     *map(str, objects)], capture_output=True, text=True,
                                    timeout=300)
            if result.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
            os.replace(built, target)


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    for name in ("paged_decode_f32", "paged_decode_bf16", "paged_decode_e4m3", "paged_decode_e5m2"):
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [p, p, p, p, i64, i64, i64, i64, p, i64, i64, p, i32, i32, i32, i32, i32,
                       f32, i32, i32, p, i32]
    lib.linear_pack_f32.restype = None
    lib.linear_pack_f32.argtypes = [p, i64, i64, i64, p]
    lib.linear_f32.restype = ctypes.c_int
    lib.linear_f32.argtypes = [p, i64, i64, i64, p, i64, p, i64, i32]
    lib.linear_pack_bf16.restype = None
    lib.linear_pack_bf16.argtypes = [p, i64, i64, i64, p]
    lib.linear_bf16.restype = ctypes.c_int
    lib.linear_bf16.argtypes = [p, i64, i64, i64, p, i64, p, i64, p, i32]
    lib.linear_q8.restype = ctypes.c_int
    lib.linear_q8.argtypes = [p, i64, i64, i64, p, p, i64, p, i64, i32]
    lib.quantize_rows_q8.restype = ctypes.c_int
    lib.quantize_rows_q8.argtypes = [p, i64, i64, i64, p, p]
    for suffix in ("f32", "bf16"):
        rms, silu = getattr(lib, f"rms_norm_{suffix}"), getattr(lib, f"silu_mul_{suffix}")
        rms.restype = silu.restype = ctypes.c_int
        rms.argtypes = [p, i64, p, i64, p, f32, i64, i64, p, i64, i32]
        silu.argtypes = [p, i64, i64, i64, p, i64, i32]
    lib.rope_store.restype = ctypes.c_int
    lib.rope_store.argtypes = [p, i32, i64, i64, i32, i32, i32, p, p, i64, p, p, p, i64, i32, i64,
                               i64, i64, p, i32, i32]


def library() -> ctypes.CDLL | None:
    """The compiled kernels (built and cached on first call), or None if they cannot be built."""
    global _library, _reason, _loaded
    if _loaded:
        return _library
    _loaded = True
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        _reason = "no C compiler found (gcc or $CC)"
        return None
    here = Path(__file__).parent
    sources = [here / name for name in _SOURCES]
    try:
        key = _build_key(compiler, b"".join(path.read_bytes()
                                            for path in sources + [here / h for h in _HEADERS]))
        target = _cache_root() / "kernels" / key / "pagedserve_native.so"
        if not target.exists():
            _compile(compiler, sources, target)
        lib = ctypes.CDLL(str(target))
        _declare(lib)
    except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as exc:
        _reason = f"native CPU kernels unavailable: {exc}"
        return None
    _library = lib
    return lib


def unavailable_reason() -> str | None:
    library()
    return _reason
