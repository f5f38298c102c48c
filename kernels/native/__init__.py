"""Native CPU kernels: C sources here, compiled on first use with the system C compiler into one
shared library per feature (features.py: decode_attention, linear, linear_q8, elementwise,
rope_store), called through ctypes (which releases the GIL for the call).

`library(feature)` returns that feature's loaded library, or None when it cannot be built or
loaded (no compiler, a compile error, a cache folder others may write to): the reason is in
`unavailable_reason(feature)`, and callers fall back to the torch path. One feature failing
leaves the others native. A cached library that exists but does not load (a truncated file) is
built again, once. Where the libraries are cached and how they are compiled: build.py; the
settings (PAGEDSERVE_CACHE, PAGEDSERVE_NATIVE_CFLAGS, CC) come from pagedserve.envs, and when they
change the next call resolves the libraries again.
"""
from __future__ import annotations

import ctypes
import logging
import subprocess
from pathlib import Path
from typing import NamedTuple

from pagedserve import envs

from . import build
from .build import cpu_flags
from .features import FEATURES, Feature

log = logging.getLogger(__name__)


class _Loaded(NamedTuple):
    library: ctypes.CDLL | None
    reason: str | None


_loaded: dict[str, _Loaded] = {}


def library(feature: str) -> ctypes.CDLL | None:
    """The feature's compiled kernels (built and cached on first call), or None if they cannot
    be built or loaded."""
    loaded = _loaded.get(feature)
    if loaded is None:
        loaded = _loaded[feature] = _load(_feature(feature))
    return loaded.library


def unavailable_reason(feature: str) -> str | None:
    """Why `library(feature)` is None (None when it loads)."""
    library(feature)
    return _loaded[feature].reason


def library_path(feature: str) -> Path:
    """Where the feature's library is cached under the current settings (needs a compiler: the
    key holds its version)."""
    compiler = build.find_compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found (gcc, cc or $CC)")
    return _target(_feature(feature), compiler)


def forget() -> None:
    """Drop the loaded libraries: the next call resolves them again (the settings changed, or a
    test changed the cache folder under them)."""
    _loaded.clear()


envs.on_change(forget)


def _feature(name: str) -> Feature:
    try:
        return FEATURES[name]
    except KeyError:
        raise ValueError(f"unknown native feature {name!r}: expected one of "
                         f"{', '.join(FEATURES)}") from None


def _load(feature: Feature) -> _Loaded:
    compiler = build.find_compiler()
    if compiler is None:
        return _Loaded(None, f"native {feature.name} kernels unavailable: no C compiler found "
                             f"(gcc, cc or $CC)")
    try:
        lib = _open(feature, compiler, _target(feature, compiler))
        for name, (restype, argtypes) in feature.signatures.items():
            function = getattr(lib, name)
            function.restype, function.argtypes = restype, list(argtypes)
    except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as exc:
        return _Loaded(None, f"native {feature.name} kernels unavailable: {exc}")
    return _Loaded(lib, None)


def _target(feature: Feature, compiler: str) -> Path:
    kernels_dir = build.private_dir(envs.current().cache_root / "kernels")
    key = build.build_key(feature.name, feature.all_sources, build.SOURCE_DIR, compiler,
                          build.flags())
    folder = build.private_dir(kernels_dir / f"{feature.name}-{key}")
    return folder / f"pagedserve_{feature.name}.so"


def _open(feature: Feature, compiler: str, target: Path) -> ctypes.CDLL:
    sources = [build.SOURCE_DIR / name for name in feature.all_sources]
    if not target.exists():
        build.compile_library(compiler, build.flags(), sources, target)
    cached = target.stat()
    try:
        return ctypes.CDLL(str(target))
    except OSError as exc:
        # A cached library that exists but does not load (truncated when a disk filled up, a
        # partial copy of the cache folder): its key says it is current, so without a rebuild
        # the feature would stay off for good.
        log.warning("native %s kernels: %s does not load (%s); building it again", feature.name,
                    target, exc)
    build.compile_library(compiler, build.flags(), sources, target, broken=cached)
    try:
        return ctypes.CDLL(str(target))
    except OSError as exc:
        raise OSError(f"{target} does not load, even rebuilt: {exc}") from None


__all__ = ["FEATURES", "cpu_flags", "forget", "library", "library_path", "unavailable_reason"]
