"""Issue 38: a request that ends the detokenizer or the ingress is quarantined, so one request
cannot restart a role again and again until the group gives up (the crash-loop rule).

The faults fire on any request whose prompt holds a token id, in every incarnation (`!`), as a
real poison request would: the detokenizer aborts (SIGABRT, as a native crash), the ingress
hangs on its event loop until the launcher kills it for its silence. Each role's breadcrumb
names the request it was working on; the launcher holds the death against it."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from pagedserve.pipeline import SamplingParams
from pagedserve.pipeline.outputs import RequestError
from faults.conftest import Group, token_ids

pytestmark = pytest.mark.slow

DETOK_POISON, INGRESS_POISON = 31337, 31338
LONG = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _post(base: str, body: bytes, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", content=body, timeout=timeout,
                      headers={"content-type": "application/json"})


def _until_served(base: str, body: bytes, deadline_s: float = 60) -> httpx.Response:
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            return _post(base, body)
        except httpx.HTTPError:
            assert time.monotonic() < deadline, "the restarted ingress does not answer"
            time.sleep(0.5)


def test_poison_requests_of_the_detokenizer_and_the_ingress_are_quarantined(model_dir,
                                                                           prompt_ids):
    group = Group(model_dir, http=True, extra=("--heartbeat-timeout", "5"),
                  fault=f"detokenizer:abort@token={DETOK_POISON}!;"
                        f"ingress:hang@token={INGRESS_POISON}!")
    base = f"http://127.0.0.1:{group.port}"
    try:
        steady = group.pids(["scheduler", "worker0"])
        detok = group.pid_of("detokenizer")
        reference = token_ids(group.submit_all(prompt_ids[:4], LONG))

        # The detokenizer: the poison fails alone, the requests beside it complete unchanged.
        others = group.submit_all(prompt_ids[:4], LONG)
        bad = group.client.submit(prompt_ids[5][:3] + [DETOK_POISON] + prompt_ids[5][3:], LONG)
        with pytest.raises(RequestError) as info:
            bad.result(120)
        assert info.value.status == 500 and "quarantined" in info.value.message
        assert "SIGABRT" in info.value.message
        assert token_ids(others) == reference
        group.wait_restarted("detokenizer", detok)
        assert group.restarts()["detokenizer"] == 1  # once, not until the crash loop

        # The ingress: the poison hangs it once; sent again it is refused, and others served.
        ingress = group.pid_of("ingress")
        poison = json.dumps({"prompt": [1, 2, INGRESS_POISON, 3], "max_tokens": 4}).encode()
        good = json.dumps({"prompt": "Hello", "max_tokens": 4, "temperature": 0}).encode()
        with pytest.raises(httpx.HTTPError):
            _post(base, poison)
        group.wait_restarted("ingress", ingress)
        group.wait_http(60)
        again = _until_served(base, poison)
        assert again.status_code == 400, again.text
        assert again.json()["error"]["code"] == "request_quarantined"
        served = _post(base, good)
        assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 4
        assert group.restarts()["ingress"] == 1
        assert group.pids(["scheduler", "worker0"]) == steady
        assert group.blocks_in_use() == 0
    finally:
        assert group.close() == 0
    assert group.leftovers() == []
