"""One library per native feature (kernels/native): a feature builds into a fresh cache alone and
reports a missing compiler, a feature that fails to compile leaves the others native, a cached
library that does not load is built again once, and a cache folder that others may write to is
refused."""
from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from native_variants import NEEDS_COMPILER

from pagedserve import envs
from pagedserve.kernels import native, native_elementwise, native_linear, paths
from pagedserve.kernels.native import FEATURES, build

pytestmark = NEEDS_COMPILER


@pytest.fixture
def fresh_cache(tmp_path):
    """An empty PAGEDSERVE_CACHE for the test (what was loaded before is resolved again)."""
    with envs.override(cache_dir=str(tmp_path / "cache")) as env:
        yield env.cache_root


def test_builds_into_a_fresh_cache_and_reports_a_missing_compiler(tmp_path):
    code = ("from pagedserve.kernels import native\n"
            "lib = native.library('rope_store')\n"
            "print('built' if lib is not None else native.unavailable_reason('rope_store'))\n")
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PAGEDSERVE_CACHE=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=300, cwd=root)
    assert result.returncode == 0 and result.stdout.strip() == "built", result.stderr[-2000:]
    # only the feature it used, in the default variant
    assert [path.parent.name.split("-")[:2] for path in tmp_path.glob("kernels/*/*.so")] == [
        ["rope_store", "native"]]
    env = dict(env, CC=str(tmp_path / "no-such-compiler"), PAGEDSERVE_CACHE=str(tmp_path / "b"))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=300, cwd=root)
    assert result.returncode == 0 and result.stdout.startswith(
        "native rope_store kernels unavailable: ") and "no-such-compiler" in result.stdout


def test_a_feature_that_fails_to_compile_leaves_the_others_native(tmp_path, monkeypatch):
    sources = tmp_path / "native"
    shutil.copytree(build.SOURCE_DIR, sources, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    broken = sources / "elementwise.c"
    broken.write_text('#error "broken on purpose"\n' + broken.read_text())
    # the other features' sources are unchanged: their keys, and so their cached libraries, are
    # the ones the other tests use
    monkeypatch.setattr(build, "SOURCE_DIR", sources)
    monkeypatch.setattr(native, "_loaded", {})
    try:
        assert native.library("elementwise") is None
        reason = native.unavailable_reason("elementwise")
        assert reason.startswith("native elementwise kernels unavailable: ") and \
            "broken on purpose" in reason
        for name in FEATURES.keys() - {"elementwise"}:
            assert native.library(name) is not None, native.unavailable_reason(name)
        assert not native_elementwise.available() and native_linear.available()
        assert paths.elementwise_path("cpu", torch.float32) == ("torch", reason)
        assert paths.rope_store_path("cpu", torch.float32, torch.float32).kernel == \
            "native rope_store.c"
    finally:
        shutil.rmtree(native.library_path("elementwise").parent, ignore_errors=True)


def test_the_cache_folder_is_created_private(fresh_cache):
    assert native.library("rope_store") is not None, native.unavailable_reason("rope_store")
    target = native.library_path("rope_store")
    for folder in (fresh_cache / "kernels", target.parent):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert target.name == "pagedserve_rope_store.so" and target.parent.name.startswith(
        "rope_store-")


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757])
def test_a_cache_folder_others_may_write_to_is_refused(fresh_cache, mode):
    kernels_dir = fresh_cache / "kernels"
    kernels_dir.mkdir(parents=True)
    kernels_dir.chmod(mode)
    assert native.library("rope_store") is None
    assert native.unavailable_reason("rope_store") == (
        f"native rope_store kernels unavailable: {kernels_dir} is writable by group or others "
        f"(mode {mode:o}): refusing to load native code from it (chmod go-w {kernels_dir})")
    assert list(kernels_dir.iterdir()) == []          # nothing built or loaded there
    kernels_dir.chmod(0o755)
    native.forget()
    assert native.library("rope_store") is not None, native.unavailable_reason("rope_store")


def test_a_cached_library_that_does_not_load_is_built_again(fresh_cache, caplog):
    target = native.library_path("rope_store")
    target.write_bytes(b"\x7fELF, cut short when the disk filled up")
    with caplog.at_level(logging.WARNING, logger="pagedserve.kernels.native"):
        assert native.library("rope_store") is not None, native.unavailable_reason("rope_store")
    assert "does not load" in caplog.text and "building it again" in caplog.text
    assert target.stat().st_size > 1000


def test_a_library_that_still_does_not_load_disables_only_its_feature(fresh_cache,
                                                                       monkeypatch):
    target = native.library_path("rope_store")
    target.write_bytes(b"junk")
    builds = []

    def build_junk(*args, **kwargs):
        builds.append(kwargs)
        target.write_bytes(b"junk again")

    monkeypatch.setattr(build, "compile_library", build_junk)
    assert native.library("rope_store") is None
    assert len(builds) == 1 and builds[0]["broken"] is not None      # one rebuild, no loop
    reason = native.unavailable_reason("rope_store")
    assert reason.startswith(f"native rope_store kernels unavailable: {target} does not load, "
                             f"even rebuilt")
