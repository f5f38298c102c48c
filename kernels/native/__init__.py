"""Native CPU kernels: C sources here, compiled on first use with the system C compiler into one
shared library per feature (features.py: decode_attention, linear, linear_q8, linear_gguf,
elementwise, rope_store, replay, lora), called through ctypes (which releases the GIL for the call).

`library(feature)` returns that feature's loaded library, or None when it cannot be built or
loaded (no compiler, a compile error, a cache folder others may write to): the reason is in
`unavailable_reason(feature)`, and callers fall back to the torch path. One feature failing
leaves the others native. A cached library that exists but does not load (a truncated file) is
built again, once. Where the libraries are cached and how they are compiled: build.py; the
settings (PAGEDSERVE_CACHE, PAGEDSERVE_NATIVE_CFLAGS, CC) come from pagedserve.envs, and when they
change the next call resolves the libraries again.

Every library is built in the selected build variant (variants.py): `native`, this CPU's best,
unless a test selects another (`use_variant("portable")`) to run the same kernels' other vector
bodies. Each variant's libraries are cached and loaded side by side; a variant this machine
cannot build or run leaves `library` None with the reason, like any other failure.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

from pagedserve import envs

from . import build, variants
from .build import cpu_flags
from .features import FEATURES, Feature
from .variants import VARIANTS, VariantUnavailable

log = logging.getLogger(__name__)


class _Loaded(NamedTuple):
    library: ctypes.CDLL | None
    reason: str | None


# by (feature, variant)
_loaded: dict[tuple[str, str], _Loaded] = {}
_variant: str | None = None   # None: PAGEDSERVE_NATIVE_VARIANT's (default: native)
_listeners: list[Callable[[], None]] = []


def library(feature: str) -> ctypes.CDLL | None:
    """The feature's compiled kernels in the selected variant (built and cached on first call),
    or None if they cannot be built or loaded."""
    key = (feature, variant())
    loaded = _loaded.get(key)
    if loaded is None:
        loaded = _loaded[key] = _load(_feature(feature), key[1])
    return loaded.library


def unavailable_reason(feature: str) -> str | None:
    """Why `library(feature)` is None (None when it loads)."""
    library(feature)
    return _loaded[(feature, variant())].reason


def library_path(feature: str) -> Path:
    """Where the feature's library is cached under the current settings and variant (needs a
    compiler: the key holds its version; VariantUnavailable where the variant is)."""
    return _target(_feature(feature), _compiler(), variant())


def variant() -> str:
    """The build variant `library` loads (variants.py): the one selected, else the
    environment's (PAGEDSERVE_NATIVE_VARIANT, e.g. avx2 to run an AVX-512 host's AVX2 bodies)."""
    return _variant if _variant is not None else envs.current().native_variant


def select_variant(name: str | None) -> None:
    """Load the libraries of variant `name` from now on (those of others stay loaded); None:
    the environment's again."""
    global _variant
    before = variant()
    _variant = None if name is None else variants.check(name)
    if variant() != before:
        for listener in _listeners:
            listener()


@contextlib.contextmanager
def use_variant(name: str | None) -> Iterator[str | None]:
    """Tests: variant `name` (None: the environment's) selected for the duration of the block."""
    before = _variant
    select_variant(name)
    try:
        yield name
    finally:
        select_variant(before)


def variant_unavailable_reason(name: str) -> str | None:
    """Why this machine cannot build or run variant `name` (no compiler, an x86 variant on
    another architecture, a CPU without its instructions); None when it can."""
    variants.check(name)
    try:
        build.variant_flags(_compiler(), name)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    return None


def on_variant_change(listener: Callable[[], None]) -> Callable[[], None]:
    """Call `listener` whenever another variant is selected (to drop choices derived from it)."""
    _listeners.append(listener)
    return listener


def forget() -> None:
    """Drop the loaded libraries: the next call resolves them again (the settings changed, or a
    test changed the cache folder under them); choices derived from the variant go too (the
    environment's variant may have changed)."""
    _loaded.clear()
    for listener in _listeners:
        listener()


envs.on_change(forget)


def _feature(name: str) -> Feature:
    try:
        return FEATURES[name]
    except KeyError:
        raise ValueError(f"unknown native feature {name!r}: expected one of "
                         f"{', '.join(FEATURES)}") from None


def _compiler() -> str:
    compiler = build.find_compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found (gcc, cc or $CC)")
    return compiler


def _load(feature: Feature, variant_name: str) -> _Loaded:
    try:
        compiler = _compiler()
        build_flags = build.flags(compiler, variant_name)
        lib = _open(feature, compiler, build_flags,
                    _target(feature, compiler, variant_name, build_flags))
        for name, (restype, argtypes) in feature.signatures.items():
            function = getattr(lib, name)
            function.restype, function.argtypes = restype, list(argtypes)
    except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as exc:
        return _Loaded(None, f"native {feature.name} kernels unavailable: {exc}")
    return _Loaded(lib, None)


def _target(feature: Feature, compiler: str, variant_name: str,
            build_flags: tuple[str, ...] | None = None) -> Path:
    if build_flags is None:
        build_flags = build.flags(compiler, variant_name)
    kernels_dir = build.private_dir(envs.current().cache_root / "kernels")
    key = build.build_key(feature.name, variant_name, feature.all_sources, build.SOURCE_DIR,
                          compiler, build_flags)
    folder = build.private_dir(kernels_dir / f"{feature.name}-{variant_name}-{key}")
    return folder / f"pagedserve_{feature.name}.so"


def _open(feature: Feature, compiler: str, build_flags: tuple[str, ...],
          target: Path) -> ctypes.CDLL:
    sources = [build.SOURCE_DIR / name for name in feature.all_sources]
    if not target.exists():
        build.compile_library(compiler, build_flags, sources, target)
    cached = target.stat()
    try:
        return ctypes.CDLL(str(target))
    except OSError as exc:
        # A cached library that exists but does not load (truncated when a disk filled up, a
        # partial copy of the cache folder): its key says it is current, so without a rebuild
        # the feature would stay off for good.
        log.warning("native %s kernels: %s does not load (%s); building it again", feature.name,
                    target, exc)
    build.compile_library(compiler, build_flags, sources, target, broken=cached)
    try:
        return ctypes.CDLL(str(target))
    except OSError as exc:
        raise OSError(f"{target} does not load, even rebuilt: {exc}") from None


__all__ = ["FEATURES", "VARIANTS", "VariantUnavailable", "cpu_flags", "forget", "library",
           "library_path", "on_variant_change", "select_variant", "unavailable_reason",
           "use_variant", "variant", "variant_unavailable_reason"]
