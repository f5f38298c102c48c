"""Two models behind one router with `--max-loaded-models 1`: requests alternating between them
evict the loaded model and load the other every time, every request succeeds, and nothing is
left behind (processes, shared memory, folders) by each evicted group or after close. Four cold
starts only: the suite's time is scarce; the choice of what to evict is ModelSlots' and
ModelManager's unit tests'."""
from __future__ import annotations

import os

import httpx
import psutil
import pytest
from pagedserve.pipeline.config import IpcArgs

from e2e.router_group import Router, alive, metric

pytestmark = pytest.mark.slow

ALTERNATING = ("alpha", "beta", "alpha", "beta")  # alpha preloaded: 3 swaps


def _loaded_group(router: Router, model: str) -> tuple[list[psutil.Process], str]:
    """The one engine group running (it serves `model`): its processes and shm tag."""
    launchers = router.launchers()
    assert len(launchers) == 1, [p.cmdline() for p in launchers]  # one group at a time
    cmd = launchers[0].cmdline()
    assert f"--served-model-name {model}" in " ".join(cmd)
    tag = IpcArgs(ipc_dir=cmd[cmd.index("--ipc-dir") + 1]).tag
    return [launchers[0], *launchers[0].children(recursive=True)], tag


def _states(router: Router) -> dict[str, str]:
    models = httpx.get(f"{router.base}/v1/models", timeout=10).json()["data"]
    return {m["id"]: m["state"] for m in models}


def test_alternating_models_load_and_evict_each_time_and_nothing_leaks(model_dir):
    router = Router("--model", f"alpha={model_dir}", "--model", f"beta={model_dir}",
                    "--max-loaded-models", "1", "--preload", "alpha", "--load-timeout", "300")
    seen: list[psutil.Process] = []  # every process of every group that ran
    try:
        assert _states(router) == {"alpha": "loaded", "beta": "unloaded"}
        group, tag = _loaded_group(router, "alpha")
        seen += group
        texts, swaps = set(), 0
        for model in ALTERNATING:
            r = httpx.post(f"{router.base}/v1/completions", timeout=600, json={
                "model": model, "prompt": "The capital of France is", "max_tokens": 4,
                "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["model"] == model
            texts.add(r.json()["choices"][0]["text"])
            new_group, new_tag = _loaded_group(router, model)
            if new_tag != tag:  # a swap: the evicted group is gone, all of it, at once
                swaps += 1
                assert alive(group) == [], model
                assert not [n for n in os.listdir("/dev/shm") if n.startswith(tag)], model
            group, tag = new_group, new_tag
            seen += group
            other = "beta" if model == "alpha" else "alpha"
            assert _states(router) == {model: "loaded", other: "unloaded"}
        assert swaps == 3
        assert len(texts) == 1  # the same weights, the same answer
        missing = httpx.post(f"{router.base}/v1/completions", timeout=10,
                             json={"model": "gamma", "prompt": "x"})
        assert missing.status_code == 404 and "gamma" in missing.json()["error"]["message"]
        samples = router.metrics()
        assert metric(samples, "router_model_loads_total", model="alpha") == 2  # preload + 1
        assert metric(samples, "router_model_loads_total", model="beta") == 2
        assert metric(samples, "router_model_evictions_total", model="alpha") == 2
        assert metric(samples, "router_model_evictions_total", model="beta") == 1
        assert metric(samples, "router_model_cold_start_seconds_count") == 4
        assert metric(samples, "router_model_cold_start_seconds_sum") > 0
    finally:
        code = router.close()
    assert code == 0
    assert alive(seen) == []
    assert router.leftovers() == []
