"""scripts/fuzz_api.py, short, against a launched group (ingress + scheduler + worker +
detokenizer on the default model): schemathesis over /openapi.json, slow clients, connections
dropped mid-request, oversized headers and bodies; then no 5xx, the KV pool back to 0 blocks, no
request left, and the next request served."""
from __future__ import annotations


import httpx
import pytest

from script_module import load_script

from faults.conftest import Group

pytestmark = pytest.mark.slow

def _fuzz_api():
    return load_script("fuzz_api")


def test_fuzzed_api_no_5xx_pool_back_to_zero_next_request_served(model_dir):
    pytest.importorskip("schemathesis")
    fuzz = _fuzz_api()
    group = Group(model_dir, http=True)
    try:
        base = f"http://127.0.0.1:{group.port}"
        out = fuzz.main(["--base-url", base, "--seed", "0", "--schema-phases", "fuzzing",
                         "--max-examples", "15", "--gen-tokens", "1", "--slow-clients", "2",
                         "--slow-seconds", "3", "--connections", "200", "--concurrency", "32",
                         "--timeout", "60", "--settle-timeout", "30", "--no-store"])
        assert out["parts"]["hostile"]["all_refused_naming_the_field"], out["parts"]["hostile"]
        assert out["parts"]["schema"]["failures"] == []
        assert out["server_errors_5xx"] == 0, out["statuses"]
        assert out["parts"]["drop"]["kinds"] == {"headers_only": 67, "half_body": 67,
                                                 "stream_first_chunk": 66}
        assert out["parts"]["slow"]["served_while_slow"]
        assert out["parts"]["slow"]["statuses"] == {"200": 3}
        assert all(400 <= s < 500 for s in out["parts"]["oversize"]["cases"].values()), out
        assert out["kv_cache_usage_after"] == 0 and out["requests_running_after"] == 0
        assert out["next_request_status"] == 200 and out["ok"]
        assert group.blocks_in_use() == 0
        assert group.client.stats()["num_unfinished_requests"] == 0
        r = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        assert r.status_code == 200
    finally:
        assert group.close() == 0
    assert group.leftovers() == []
