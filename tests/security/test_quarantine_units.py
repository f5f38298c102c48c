"""Issue 38, the parts of quarantine that need no process group: the breadcrumb outlives the
process that wrote it and names what ran when it died; the ingress refuses a quarantined
body before parsing it. (The detokenizer's isolation: tests/pipeline/test_detokenizer_isolation.py.)"""
from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys

import pytest

from pagedserve.breadcrumb import Breadcrumb, load_keys, read_breadcrumb, save_keys
from pagedserve.pipeline.ingress.errors import APIError
from pagedserve.pipeline.ingress.request_guard import RequestGuard
from pagedserve.private_files import PrivateFileError


def test_a_mark_names_the_running_work_and_is_restored_after_it(tmp_path):
    path = str(tmp_path / "role.breadcrumb")
    crumb = Breadcrumb(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert read_breadcrumb(path) is None
    with crumb.mark("outer"):
        assert read_breadcrumb(path) == "outer"
        with crumb.mark("inner"):
            assert read_breadcrumb(path) == "inner"
        assert read_breadcrumb(path) == "outer"
        crumb.mark_now("moved-on")
        assert read_breadcrumb(path) == "moved-on"
    assert read_breadcrumb(path) is None
    crumb.close()
    assert not os.path.exists(path)


def test_the_mark_of_a_killed_process_is_read_after_its_death(tmp_path):
    path = str(tmp_path / "role.breadcrumb")
    code = ("import os, signal, sys; from pagedserve.breadcrumb import Breadcrumb\n"
            "crumb = Breadcrumb(sys.argv[1])\n"
            "with crumb.mark('req-42'):\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = subprocess.run([sys.executable, "-c", code, path])
    assert proc.returncode == -signal.SIGKILL
    assert read_breadcrumb(path) == "req-42"
    Breadcrumb(path).close()  # the next incarnation starts from a fresh file


def test_a_breadcrumb_open_to_others_is_refused(tmp_path):
    path = tmp_path / "role.breadcrumb"
    Breadcrumb(str(path))
    os.chmod(path, 0o644)
    with pytest.raises(PrivateFileError, match="open to other users"):
        read_breadcrumb(str(path))


def test_quarantine_keys_round_trip_in_a_private_file(tmp_path):
    path = str(tmp_path / "ingress.quarantine")
    assert load_keys(path) == frozenset()
    save_keys(path, ["a" * 32, "b" * 32])
    save_keys(path, ["a" * 32, "b" * 32, "c" * 32])  # replaced, not appended
    assert load_keys(path) == {"a" * 32, "b" * 32, "c" * 32}
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_the_ingress_refuses_a_quarantined_body_by_its_key():
    body = b'{"prompt": "x"}'
    key = RequestGuard.key("/v1/completions", body)
    guard = RequestGuard(quarantined=[key])
    assert guard.admit("/v1/completions", body + b" ") != key  # another body is another key
    assert guard.admit("/v1/chat/completions", body) != key
    with pytest.raises(APIError) as info:
        guard.admit("/v1/completions", body)
    assert info.value.status == 400 and "ended the server's HTTP process" in info.value.message
