"""workers/heap.py: an idle worker trims its heap once per idle spell."""
from __future__ import annotations

import ctypes

import pytest

from pagedserve.workers import heap


def test_an_idle_spell_trims_once_and_only_after_work(monkeypatch):
    try:
        ctypes.CDLL(None).malloc_trim
    except AttributeError:
        pytest.skip("not glibc")
    calls = []
    real = heap.trim_heap
    monkeypatch.setattr(heap, "trim_heap", lambda: calls.append(1) or real())
    trim = heap.IdleTrim(after_s=0.5)
    assert trim.after_ms == 500
    trim.idle()                     # nothing ran yet: nothing to give back
    assert calls == [] and trim.trims == 0
    trim.busy()
    trim.idle()
    trim.idle()                     # the same idle spell
    assert calls == [1] and trim.trims == 1
    trim.busy()
    trim.idle()
    assert calls == [1, 1] and trim.trims == 2
