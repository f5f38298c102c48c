"""Engine config: the CPU thread default and its flag."""
import os

import pytest

from pipeline.config import ParallelArgs, build_arg_parser, config_from_args


def _cfg(*argv):
    return config_from_args(build_arg_parser().parse_args(list(argv)))


def test_cpu_threads_default_splits_the_cores_between_the_ranks(monkeypatch):
    def threads(*argv):
        return _cfg(*argv).parallel.threads_per_rank()

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert threads() == 8
    assert threads("--tensor-parallel-size", "2") == 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert threads() == 2
    assert threads("-tp", "2") == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert threads() == 1


def test_cpu_threads_flag_wins_and_is_checked():
    parallel = _cfg("--cpu-threads", "2").parallel
    assert parallel.threads_per_rank() == 2
    with pytest.raises(ValueError, match="--cpu-threads must be >= 1, got 0"):
        _cfg("--cpu-threads", "0")
    with pytest.raises(ValueError, match="--cpu-threads"):
        ParallelArgs(cpu_threads=-3)


def test_kv_cache_dtype_flag():
    assert _cfg().cache.kv_cache_dtype == "auto"
    assert _cfg("--kv-cache-dtype", "fp8").cache.kv_cache_dtype == "fp8"
    with pytest.raises(SystemExit):   # argparse names the choices
        _cfg("--kv-cache-dtype", "int4")
    from pipeline.config import EngineConfig
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of auto, float32, .*got 'q8'"):
        EngineConfig.from_kwargs(kv_cache_dtype="q8")
