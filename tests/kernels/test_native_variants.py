"""Build variants of the native kernels (kernels/native/variants.py): each maps to the flags of
the machine's architecture, one this machine cannot build or run is unavailable with the reason
(never a failed build), the variant is part of the cache key, and every source builds in every
variant that is available here. A simulated aarch64 host (its architecture and CPU flags, and a
compiler that refuses x86 options as aarch64 gcc does) builds the portable variant."""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from native_variants import NEEDS_COMPILER

from pagedserve import envs
from pagedserve.kernels import native, native_elementwise
from pagedserve.kernels.native import FEATURES, build, variants
from pagedserve.kernels.native.variants import VariantUnavailable, resolve

SAPPHIRE_RAPIDS = {"sse2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "amx_bf16"}
AVX2_ONLY = {"sse2", "avx", "avx2", "fma", "f16c"}
NEOVERSE = {"fp", "asimd", "atomics", "sve", "bf16"}
AVX2_FLAGS = ("-march=x86-64", "-mavx2", "-mfma", "-mf16c")


def accepts_all(flags):
    return True


def accepts_only(*accepted):
    return lambda flags: flags in accepted


@pytest.mark.parametrize("variant,arch,cpu,accepts,expected", [
    ("native", "x86_64", AVX2_ONLY, accepts_all, ("-march=native",)),
    ("avx512", "x86_64", SAPPHIRE_RAPIDS, accepts_all, AVX2_FLAGS + ("-mavx512f",)),
    ("avx2", "x86_64", SAPPHIRE_RAPIDS, accepts_all, AVX2_FLAGS),
    ("portable", "x86_64", SAPPHIRE_RAPIDS, accepts_all, ("-march=x86-64",)),
    ("native", "aarch64", NEOVERSE, accepts_all, ("-mcpu=native",)),
    ("native", "aarch64", NEOVERSE, accepts_only(("-march=native",)), ("-march=native",)),
    ("native", "aarch64", NEOVERSE, accepts_only(), ()),          # the compiler's default
    ("portable", "aarch64", NEOVERSE, accepts_all, ("-march=armv8-a",)),
    ("native", "ppc64le", set(), accepts_only(("-mcpu=native",)), ("-mcpu=native",)),
    ("portable", "riscv64", set(), accepts_all, ()),
], ids=lambda value: value.__name__ if callable(value) else None)
def test_each_variant_maps_to_its_architectures_flags(variant, arch, cpu, accepts, expected):
    assert resolve(variant, arch, cpu, accepts) == expected


@pytest.mark.parametrize("variant,arch,cpu,accepts,reason", [
    ("avx2", "aarch64", NEOVERSE, accepts_all,
     "the avx2 build is for x86-64 CPUs; this machine is aarch64"),
    ("avx512", "riscv64", set(), accepts_all,
     "the avx512 build is for x86-64 CPUs; this machine is riscv64"),
    ("avx512", "x86_64", AVX2_ONLY, accepts_all,
     "the avx512 build needs a CPU with avx, avx2, avx512f, f16c, fma; this one has no avx512f"),
    ("avx2", "x86_64", {"sse2", "avx"}, accepts_all,
     "the avx2 build needs a CPU with avx, avx2, f16c, fma; this one has no avx2, f16c, fma"),
    ("avx2", "x86_64", set(), accepts_all,
     ("the avx2 build needs a CPU with avx, avx2, f16c, fma; this machine's CPU flags cannot be "
      "read (no flags line in /proc/cpuinfo)")),
    ("portable", "x86_64", AVX2_ONLY, accepts_only(),
     "the portable build: the compiler rejects -march=x86-64"),
], ids=lambda value: value.__name__ if callable(value) else None)
def test_a_variant_this_machine_cannot_build_or_run_says_why(variant, arch, cpu, accepts, reason):
    with pytest.raises(VariantUnavailable) as raised:
        resolve(variant, arch, cpu, accepts)
    assert str(raised.value) == reason


def test_architecture_names_and_unknown_variants():
    assert [variants.architecture(m) for m in ("x86_64", "AMD64", "aarch64", "arm64", "ppc64le")
            ] == ["x86_64", "x86_64", "aarch64", "aarch64", "ppc64le"]
    with pytest.raises(ValueError, match="unknown native build variant 'sse'"):
        native.select_variant("sse")
    assert variants.DEFAULT == "native"                 # what workers load: this CPU's best


@pytest.fixture
def fresh_cache(tmp_path):
    with envs.override(cache_dir=str(tmp_path / "cache")) as env:
        yield env.cache_root


@NEEDS_COMPILER
def test_an_unavailable_variant_leaves_its_libraries_off_with_the_reason(fresh_cache,
                                                                           monkeypatch):
    monkeypatch.setattr(build, "machine", lambda: "x86_64")
    monkeypatch.setattr(build, "cpu_flags", lambda: set(AVX2_ONLY))     # an AVX2-only CPU
    why = ("the avx512 build needs a CPU with avx, avx2, avx512f, f16c, fma; this one has no "
           "avx512f")
    before = native.variant()
    assert native.variant_unavailable_reason("avx512") == why
    with native.use_variant("avx512"):
        assert native.library("elementwise") is None
        assert native.unavailable_reason("elementwise") == (
            f"native elementwise kernels unavailable: {why}")
        assert not native_elementwise.available()
    assert not (fresh_cache / "kernels").exists() or not any(
        (fresh_cache / "kernels").iterdir())                    # nothing was built for it
    assert native.variant() == before and native_elementwise.available()


@NEEDS_COMPILER
def test_the_variant_is_part_of_the_cache_key():
    compiler = build.find_compiler()
    folders = {}
    for name in native.VARIANTS:
        if native.variant_unavailable_reason(name) is None:
            with native.use_variant(name):
                folders[name] = native.library_path("rope_store").parent
    assert len(set(folders.values())) == len(folders) >= 2            # portable, native at least
    for name, folder in folders.items():
        assert folder.name.startswith(f"rope_store-{name}-")
    # the same flags under two names (native and portable where no native flag exists) still
    # key apart: which variant a library is stays true to its name
    feature = FEATURES["rope_store"]
    keys = {build.build_key(feature.name, name, feature.all_sources, build.SOURCE_DIR, compiler,
                            build.BASE_FLAGS) for name in native.VARIANTS}
    assert len(keys) == len(native.VARIANTS)


def test_every_source_and_header_belongs_to_a_feature():
    # so that building every feature in every variant compiles every file of kernels/native
    built = {path.name for feature in FEATURES.values()
             for path in build.local_files(feature.all_sources, build.SOURCE_DIR)}
    assert built == {path.name for pattern in ("*.c", "*.h")
                     for path in build.SOURCE_DIR.glob(pattern)}


@NEEDS_COMPILER
@pytest.mark.usefixtures("native_variant")
@pytest.mark.parametrize("name", list(FEATURES))
def test_every_feature_builds_in_every_variant(name):
    assert native.library(name) is not None, native.unavailable_reason(name)


# aarch64 gcc's view of options, in front of this machine's compiler: x86-only ones are errors,
# its own are accepted (and dropped, since the compiler behind builds for this machine).
_AARCH64_GCC = '''#!{python}
import os, re, sys
X86 = re.compile(r"-m(no-)?(avx|fma|f16c|sse|mmx|bmi|amx)|-march=(x86-64|haswell|skylake)")
for arg in sys.argv[1:]:
    if X86.match(arg):
        sys.exit(f"gcc: error: unrecognized command-line option '{{arg}}'")
args = [a for a in sys.argv[1:] if a not in ("-mcpu=native", "-march=armv8-a")]
os.execvp({compiler!r}, [{compiler!r}] + args)
'''


@NEEDS_COMPILER
def test_a_simulated_aarch64_host_builds_the_portable_variant(tmp_path, fresh_cache,
                                                              monkeypatch):
    gcc = tmp_path / "aarch64-gcc"
    gcc.write_text(_AARCH64_GCC.format(python=sys.executable, compiler=build.find_compiler()))
    gcc.chmod(0o755)
    monkeypatch.setattr(build, "machine", lambda: "aarch64")
    monkeypatch.setattr(build, "cpu_flags", lambda: set(NEOVERSE))
    with envs.override(cc=str(gcc)):
        for name in ("avx2", "avx512"):
            assert native.variant_unavailable_reason(name) == (
                f"the {name} build is for x86-64 CPUs; this machine is aarch64")
        assert build.variant_flags(str(gcc), "native") == ("-mcpu=native",)
        assert build.variant_flags(str(gcc), "portable") == ("-march=armv8-a",)
        with native.use_variant("portable"):
            assert native_elementwise.available(), native.unavailable_reason("elementwise")
            x, weight = torch.randn(3, 40), torch.randn(40)
            torch.testing.assert_close(native_elementwise.rms_norm(x, weight, 1e-5),
                                       F.rms_norm(x, (40,), weight, 1e-5), rtol=2e-6, atol=1e-6)
        # what the tests did before variants: x86 flags, which such a compiler refuses
        with envs.override(native_cflags="-mno-avx512f -mno-avx2 -mno-fma"):
            assert native.library("elementwise") is None
            assert "unrecognized command-line option '-mno-avx512f'" in \
                native.unavailable_reason("elementwise")


def test_the_environment_chooses_the_variant_a_selection_overrides():
    """PAGEDSERVE_NATIVE_VARIANT (e.g. avx2 on an AVX-512 host, to measure what most laptops
    run) is the variant until a test selects another; the selection's end returns to it."""
    with native.use_variant(None):                  # whatever this module's fixture selected
        with envs.override(native_variant="portable"):
            assert native.variant() == "portable"
            with native.use_variant("native"):
                assert native.variant() == "native"
            assert native.variant() == "portable"
        assert native.variant() == envs.current().native_variant
    with pytest.raises(ValueError, match="PAGEDSERVE_NATIVE_VARIANT='sse9'"):
        envs.Environment(native_variant="sse9")
