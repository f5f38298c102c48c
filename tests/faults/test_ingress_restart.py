"""Killing the HTTP ingress drops only its own connections; the scheduler frees their blocks."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from faults.conftest import Group

pytestmark = pytest.mark.slow


def test_ingress_kill_drops_its_clients_frees_blocks_and_restarts(model_dir):
    group = Group(model_dir, http=True)
    base = f"http://127.0.0.1:{group.port}"
    model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
    errors, started = [], threading.Semaphore(0)

    def stream(i: int) -> None:
        body = {"model": model, "prompt": f"Count slowly to one hundred, number {i}:",
                "max_tokens": 400, "ignore_eos": True, "stream": True, "temperature": 0}
        try:
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
                for n, _line in enumerate(r.iter_lines()):
                    if n == 2:
                        started.release()
            errors.append(None)
        except httpx.HTTPError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    try:
        for t in threads:
            t.start()
        for _ in threads:
            assert started.acquire(timeout=300)
        assert group.client.stats()["kv_blocks_used"] > 0
        killed = group.kill("ingress")
        for t in threads:
            t.join(60)
        assert len(errors) == 8 and all(e is not None for e in errors)
        assert group.blocks_in_use() == 0  # the scheduler noticed the silent client
        group.wait_http(120)   # the ingress came back
        r = httpx.post(f"{base}/v1/completions", timeout=120,
                       json={"model": model, "prompt": "Hello", "max_tokens": 5})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        assert group.pid_of("ingress") != killed and group.restarts()["ingress"] == 1
    finally:
        assert group.close() == 0
    assert group.leftovers() == []


def test_a_hung_ingress_is_restarted_and_serves_again(model_dir):
    """The ingress's event loop blocks on its 3rd HTTP request (PAGEDSERVE_FAULT hang): its
    heartbeats stop, the launcher restarts it, and the next requests are served."""
    # no /health polling first: the fault counts the ingress's HTTP messages
    group = Group(model_dir, http=True, fault="ingress:hang@msg=3", wait_http=False)
    base = f"http://127.0.0.1:{group.port}"
    try:
        first = group.pid_of("ingress")
        model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]  # message 1
        body = {"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        assert httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 200
        with pytest.raises(httpx.HTTPError):  # message 3 hangs the loop until the restart
            httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert group.wait_restarted("ingress", first) != first
        assert group.restarts()["ingress"] == 1
        deadline = time.monotonic() + 60
        while True:
            try:
                r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "the restarted ingress does not answer"
                time.sleep(0.5)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert group.blocks_in_use() == 0
    finally:
        assert group.close() == 0
    assert group.leftovers() == []
