"""Environment variables are read in one module (pagedserve/envs.py), once, and travel to every
role inside the engine configuration."""
import re
from pathlib import Path

import pytest

from pagedserve import envs
from pagedserve.pipeline.cli_args import build_arg_parser, config_from_args
from pagedserve.pipeline.config import EngineConfig

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for top in ("pagedserve", "pipeline", "workers", "kernels", "kvmanager")
           for p in (ROOT / top).rglob("*.py")]


def test_no_module_but_envs_reads_a_pagedserve_variable():
    reads = re.compile(r"""(environ(\.get)?\s*[\[(]|getenv\s*\()\s*["'](PAGEDSERVE_|CC["'])""")
    offenders = [f"{p.relative_to(ROOT)}:{n}" for p in SOURCES if p.name != "envs.py"
                 for n, line in enumerate(p.read_text().splitlines(), 1) if reads.search(line)]
    assert offenders == []


def test_every_variable_is_documented_in_the_table():
    doc = envs.__doc__
    for variable in envs.VARIABLES:
        assert f"| {variable} |" in doc or variable == envs.ROLE_VARIABLE, variable
    assert envs.ROLE_VARIABLE in doc


def test_values_are_parsed_and_checked():
    env = envs.from_environ({"PAGEDSERVE_PREPACK": "0", "PAGEDSERVE_ATTENTION_THREADS": "3",
                             "PAGEDSERVE_READY_TIMEOUT": "5.5", "PAGEDSERVE_CACHE": "/c",
                             "PAGEDSERVE_FP32_LINEAR": "onednn", "UNRELATED": "x"})
    assert (env.prepack, env.attention_threads, env.ready_timeout) == (False, 3, 5.5)
    assert env.cache_root == Path("/c") and env.fp32_linear == "onednn"
    with pytest.raises(ValueError, match="PAGEDSERVE_DECODE_CPU='fast'"):
        envs.from_environ({"PAGEDSERVE_DECODE_CPU": "fast"})
    with pytest.raises(ValueError, match="PAGEDSERVE_PREPACK='yes'"):
        envs.from_environ({"PAGEDSERVE_PREPACK": "yes"})


def test_the_launchers_reading_travels_in_the_config(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_STEP_TRACE", "/tmp/trace.jsonl")
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "k1")
    cfg = config_from_args(build_arg_parser().parse_args([]))
    assert cfg.env.step_trace == "/tmp/trace.jsonl" and cfg.server.api_key == "k1"
    monkeypatch.delenv("PAGEDSERVE_STEP_TRACE")  # a child reads the config, not its environment
    back = EngineConfig.from_json(cfg.to_json())
    assert back.env == cfg.env and back.server.api_key == "k1"
    explicit = config_from_args(build_arg_parser().parse_args(["--api-key", "k2"]))
    assert explicit.server.api_key == "k2"


def test_install_and_override_notify_listeners():
    seen = []
    listener = envs.on_change(lambda: seen.append(envs.current().prepack))
    try:
        before = envs.current()
        with envs.override(prepack=not before.prepack):
            assert envs.current().prepack is (not before.prepack)
        assert envs.current() == before
        assert seen == [not before.prepack, before.prepack]
    finally:
        envs._listeners.remove(listener)
