"""Build variants of the native kernels: which vector body a library is compiled with, as the
compiler flags of this machine's architecture.

| variant  | x86-64                             | aarch64                  | other             |
|----------|------------------------------------|--------------------------|-------------------|
| native   | -march=native                      | -mcpu=native             | -m{cpu,arch}=native |
| avx512   | x86-64 + AVX2, FMA, F16C, AVX-512F | unavailable              | unavailable       |
| avx2     | x86-64 + AVX2, FMA, F16C           | unavailable              | unavailable       |
| portable | -march=x86-64 (SSE2)               | -march=armv8-a (AdvSIMD) | compiler default  |

`native` is what workers load: the best this CPU runs (the compiler's default target where it
accepts no native flag). The others are fixed targets, one per vector body the sources hold
(their __AVX512F__ / __AVX2__ guards choose it at compile time), so that tests can check every
body this machine can run against the same references, whatever its default is. avx2 and avx512
add only what those guards test, over the x86-64 baseline, so nothing else differs from portable.

A variant this machine cannot run (avx2 on aarch64, avx512 on a CPU without AVX-512) or its
compiler cannot build is unavailable: `resolve` raises VariantUnavailable with the reason.
"""
from __future__ import annotations

from collections.abc import Callable, Collection
from typing import NamedTuple

from pagedserve.envs import NATIVE_VARIANTS

VARIANTS = NATIVE_VARIANTS   # PAGEDSERVE_NATIVE_VARIANT chooses among them
DEFAULT = "native"

X86_64, AARCH64 = "x86_64", "aarch64"
_ARCHITECTURES = {"x86_64": X86_64, "amd64": X86_64, "x64": X86_64, "aarch64": AARCH64,
                  "arm64": AARCH64}


class VariantUnavailable(RuntimeError):
    """This machine cannot build or run the variant; the message says why."""


class _Target(NamedTuple):
    candidates: tuple[tuple[str, ...], ...]    # flag sets: the first the compiler accepts
    needs: frozenset[str]                      # CPU flags (/proc/cpuinfo names) the code uses


_NATIVE_ELSEWHERE = _Target((("-mcpu=native",), ("-march=native",), ()), frozenset())
_AVX2 = ("-march=x86-64", "-mavx2", "-mfma", "-mf16c")
_AVX2_CPU = frozenset({"avx", "avx2", "fma", "f16c"})

# (variant, architecture) -> target; architecture None: any other than those named
_TARGETS: dict[tuple[str, str | None], _Target] = {
    ("native", X86_64): _Target((("-march=native",), ()), frozenset()),
    ("native", AARCH64): _NATIVE_ELSEWHERE,
    ("native", None): _NATIVE_ELSEWHERE,
    ("avx512", X86_64): _Target((_AVX2 + ("-mavx512f",),), _AVX2_CPU | {"avx512f"}),
    ("avx2", X86_64): _Target((_AVX2,), _AVX2_CPU),
    ("portable", X86_64): _Target((("-march=x86-64",),), frozenset()),
    ("portable", AARCH64): _Target((("-march=armv8-a",),), frozenset()),
    ("portable", None): _Target(((),), frozenset()),
}


def architecture(machine: str) -> str:
    """platform.machine() by one name per architecture: x86_64, aarch64, or itself, lowercase."""
    return _ARCHITECTURES.get(machine.lower(), machine.lower() or "unknown")


def check(variant: str) -> str:
    if variant not in VARIANTS:
        raise ValueError(f"unknown native build variant {variant!r}: expected one of "
                         f"{', '.join(VARIANTS)}")
    return variant


def resolve(variant: str, arch: str, cpu_flags: Collection[str],
            accepts: Callable[[tuple[str, ...]], bool]) -> tuple[str, ...]:
    """The flags that build `variant` on a machine of `arch` whose CPU has `cpu_flags`, with a
    compiler that `accepts` a flag set or not; VariantUnavailable with the reason otherwise."""
    target = _TARGETS.get((check(variant), arch))
    if target is None and arch not in (X86_64, AARCH64):
        target = _TARGETS.get((variant, None))
    if target is None:
        raise VariantUnavailable(f"the {variant} build is for x86-64 CPUs; this machine is {arch}")
    missing = sorted(target.needs - set(cpu_flags))
    if missing:
        why = (f"this one has no {', '.join(missing)}" if cpu_flags else
               "this machine's CPU flags cannot be read (no flags line in /proc/cpuinfo)")
        raise VariantUnavailable(f"the {variant} build needs a CPU with "
                                 f"{', '.join(sorted(target.needs))}; {why}")
    for flags in target.candidates:
        if not flags or accepts(flags):        # no flags: the compiler's default target
            return flags
    raise VariantUnavailable(f"the {variant} build: the compiler rejects "
                             f"{' and '.join(' '.join(flags) for flags in target.candidates)}")
