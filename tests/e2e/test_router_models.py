"""Two models behind one router with `--max-loaded-models 1`: a request for the other model
evicts the loaded one and loads its own, every request succeeds, and nothing is left behind
(processes, shared memory, folders). Two cold starts only: the suite's time is scarce; the
choice of what to evict is ModelSlots' and ModelManager's unit tests'."""
from __future__ import annotations

import httpx
import pytest

from tests.e2e.router_group import Router, metric

pytestmark = pytest.mark.slow


def test_a_second_model_evicts_the_first_with_one_slot_and_nothing_leaks(model_dir):
    router = Router("--model", f"alpha={model_dir}", "--model", f"beta={model_dir}",
                    "--max-loaded-models", "1", "--preload", "alpha", "--load-timeout", "300")
    try:
        assert len(router.launchers()) == 1  # alpha, preloaded; beta waits for a request
        models = httpx.get(f"{router.base}/v1/models", timeout=10).json()["data"]
        assert {m["id"]: m["state"] for m in models} == {"alpha": "loaded", "beta": "unloaded"}
        texts = {}
        for model in ("alpha", "beta", "beta"):
            r = httpx.post(f"{router.base}/v1/completions", timeout=600, json={
                "model": model, "prompt": "The capital of France is", "max_tokens": 6,
                "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["model"] == model
            texts.setdefault(model, set()).add(r.json()["choices"][0]["text"])
            launchers = router.launchers()
            assert len(launchers) == 1, [p.cmdline() for p in launchers]  # one group at a time
            assert f"--served-model-name {model}" in " ".join(launchers[0].cmdline())
        assert len(texts["alpha"] | texts["beta"]) == 1  # the same weights, the same answer
        missing = httpx.post(f"{router.base}/v1/completions", timeout=10,
                             json={"model": "gamma", "prompt": "x"})
        assert missing.status_code == 404 and "gamma" in missing.json()["error"]["message"]
        samples = router.metrics()
        assert metric(samples, "router_model_loads_total", model="alpha") == 1
        assert metric(samples, "router_model_loads_total", model="beta") == 1
        assert metric(samples, "router_model_evictions_total", model="alpha") == 1
        assert metric(samples, "router_model_evictions_total", model="beta") == 0
        assert metric(samples, "router_model_cold_start_seconds_count") == 2
        assert metric(samples, "router_model_cold_start_seconds_sum") > 0
    finally:
        code = router.close()
    assert code == 0
    assert router.leftovers() == []
