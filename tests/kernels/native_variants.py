"""What the native kernel tests need to know about build variants (kernels/native/variants.py):
whether a compiler exists at all, and which vector body each variant must build here.

A module of its own rather than conftest.py, for the reason given in triton_mode.py; the
`native_variant` fixture that runs a test module once per variant is in conftest.py.
"""
from __future__ import annotations

import shutil

import pytest

from pagedserve.kernels import native
from pagedserve.kernels.native import build


def _compiler_missing() -> bool:
    compiler = build.find_compiler()
    return compiler is None or shutil.which(compiler) is None


# Only a missing compiler skips a native test module: a source that does not compile in a
# variant this machine can build must fail its tests, not skip them.
NEEDS_COMPILER = pytest.mark.skipif(_compiler_missing(), reason="no C compiler")

# every native test module: NEEDS_COMPILER, and each test once per build variant
PER_VARIANT = [NEEDS_COMPILER, pytest.mark.usefixtures("native_variant")]


def expected_vector_lanes(variant: str) -> int:
    """The lanes of decode attention's vector body (paged_attention.h) that `variant` must
    build on this machine: 16 with AVX-512, 8 with AVX2 + FMA + F16C, 0 (the portable body)."""
    if variant == "native":
        flags = native.cpu_flags() if build.machine() == "x86_64" else set()
        return 16 if "avx512f" in flags else 8 if {"avx2", "fma", "f16c"} <= flags else 0
    return {"avx512": 16, "avx2": 8, "portable": 0}[variant]


def native_duplicates_a_fixed_variant() -> str | None:
    """On x86-64 the native build compiles the same vector body as the avx512 or avx2 variant
    (the sources choose by __AVX512F__ / __AVX2__ alone), so running the tests on both would
    only repeat them: the reason to skip native, or None where it differs (other machines)."""
    if build.machine() != "x86_64":
        return None
    lanes = expected_vector_lanes("native")
    twin = {16: "avx512", 8: "avx2", 0: "portable"}[lanes]
    if native.variant_unavailable_reason(twin) is not None:
        return None
    return f"the native build here runs the {twin} variant's body, tested as {twin}"
