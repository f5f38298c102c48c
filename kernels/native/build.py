"""Compiling one native feature into a cached shared library.

A library lives at <cache>/kernels/<feature>-<variant>-<key>/pagedserve_<feature>.so, keyed by its
sources and the local headers they include, the compiler and its flags, the build variant
(variants.py: native, avx512, avx2, portable, mapped to flags for this architecture) and the
CPU's feature flags: a second process or a restarted worker loads it in milliseconds, and a
machine with other CPU features builds its own. Concurrent builders (tensor-parallel ranks starting
together) serialize on a file lock in the key's folder; the library is renamed into place
atomically, so a reader never sees half a file that this code wrote.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import platform
import re
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

from pagedserve import envs

from . import variants

SOURCE_DIR = Path(__file__).parent
# every variant's; the target (-march, -mcpu, -m<isa>) comes from the variant
BASE_FLAGS = ("-O3", "-fopenmp", "-pthread", "-fPIC",
              "-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros")
_TIMEOUT_S = 300
_INCLUDE = re.compile(rb'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


class UnsafeCache(RuntimeError):
    """The cache folder could be written by someone else: loading code from it would run theirs."""


def find_compiler() -> str | None:
    return envs.current().cc or shutil.which("gcc") or shutil.which("cc")


def machine() -> str:
    """This machine's architecture: x86_64, aarch64, or what platform.machine() says."""
    return variants.architecture(platform.machine())


@functools.cache
def compiler_accepts(compiler: str, target_flags: tuple[str, ...]) -> bool:
    """Whether `compiler` builds a C file with these flags, warning-free (clang only warns about
    some flags it ignores). OSError when the compiler cannot be run at all."""
    result = subprocess.run([compiler, *target_flags, "-Werror", "-x", "c", "-c", "-o",
                             os.devnull, "-"], input="int pagedserve_probe;\n",
                            capture_output=True, text=True, timeout=60)
    return result.returncode == 0


def variant_flags(compiler: str, variant: str) -> tuple[str, ...]:
    """The target flags of `variant` here; VariantUnavailable with the reason where this machine
    cannot build or run it."""
    return variants.resolve(variant, machine(), cpu_flags(),
                            functools.partial(compiler_accepts, compiler))


def flags(compiler: str, variant: str = variants.DEFAULT) -> tuple[str, ...]:
    """BASE_FLAGS, the variant's target flags, then PAGEDSERVE_NATIVE_CFLAGS (an extra: tests
    choose variants, not raw flags, which would be x86-only)."""
    return (BASE_FLAGS + variant_flags(compiler, variant)
            + tuple(envs.current().native_cflags.split()))


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
    none): what -march=native builds for, what decides which variants run here, and what other
    CPU choices go by."""
    line = _cpu_flags_line()
    return set(line.split(":", 1)[1].split()) if ":" in line else set()


@functools.cache
def _compiler_version(compiler: str) -> str:
    return subprocess.run([compiler, "--version"], capture_output=True, text=True,
                          timeout=30).stdout


def local_files(sources: tuple[str, ...], directory: Path) -> list[Path]:
    """The sources and every header of `directory` they include, directly or not (sorted)."""
    seen: set[str] = set()
    pending = list(sources)
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        pending.extend(include.decode() for include in _INCLUDE.findall(
            (directory / name).read_bytes()) if (directory / include.decode()).exists())
    return [directory / name for name in sorted(seen)]


def build_key(name: str, variant: str, sources: tuple[str, ...], directory: Path, compiler: str,
              build_flags: tuple[str, ...]) -> str:
    digest = hashlib.sha256()
    parts = [name.encode(), variant.encode()]
    for path in local_files(sources, directory):
        parts += [path.name.encode(), path.read_bytes()]
    parts += [" ".join(build_flags).encode(), _compiler_version(compiler).encode(),
              _cpu_flags_line().encode(), platform.machine().encode()]
    for part in parts:
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:20]


def private_dir(path: Path) -> Path:
    """`path`, created 0o700 if missing; UnsafeCache if group or others may write to it."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeCache(f"{path} is writable by group or others (mode {mode:o}): refusing to "
                          f"load native code from it (chmod go-w {path})")
    return path


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_ino, a.st_dev, a.st_size, a.st_mtime_ns) == (b.st_ino, b.st_dev, b.st_size,
                                                              b.st_mtime_ns)


def compile_library(compiler: str, build_flags: tuple[str, ...], sources: list[Path],
                    target: Path, broken: os.stat_result | None = None) -> None:
    """Build `target` from `sources` unless it exists; with `broken` (the stat of a target that
    failed to load), replace it unless another process already did."""
    with open(private_dir(target.parent) / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists() and (broken is None or not _same_file(target.stat(), broken)):
            return
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            objects = [Path(tmp) / (src.stem + ".o") for src in sources]
            # one compiler per translation unit, in parallel (the decode formats take seconds)
            jobs = [subprocess.Popen([compiler, *build_flags, "-c", "-o", str(obj), str(src)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                    for src, obj in zip(sources, objects)]
            failures = [err for err in map(_finish, jobs) if err is not None]
            if failures:
                raise RuntimeError(f"{compiler} failed: {failures[0][-2000:]}")
            result = subprocess.run([compiler, *build_flags, "-shared", "-o", str(built),
                                     *map(str, objects)], capture_output=True, text=True,
                                    timeout=_TIMEOUT_S)
            if result.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
            os.replace(built, target)


def _finish(job: subprocess.Popen) -> str | None:
    """Wait for one compiler; its error output if it failed."""
    try:
        _, err = job.communicate(timeout=_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        job.kill()
        _, err = job.communicate()
        err = f"timed out after {_TIMEOUT_S} s\n{err}"
    return err.strip() if job.returncode != 0 else None
