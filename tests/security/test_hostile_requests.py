"""Each hostile request of issue 38, sent once to a running group without a key: a clear 4xx naming
the field within seconds, the same pids for every role, every role's RSS bounded, and the next
good request served. Before the fixes, the 300,000-character stop string grew the detokenizer to
2.4 GB and crash-looped the server, and the body of escaped quotes held the ingress's event loop
for minutes."""
from __future__ import annotations

import random
import time

import httpx
import psutil
import pytest

from pagedserve.pipeline.ingress.testing import make_tiny_tokenizer
from pagedserve.workers.testing import make_tiny_llama
from faults.conftest import Group
from script_module import load_script

hostile_requests = load_script("hostile_requests")

pytestmark = pytest.mark.slow
ROLES = ("scheduler", "worker0", "detokenizer", "ingress")
RSS_GROWTH_LIMIT = 256 * 2**20   # per role, over the whole module
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    model_dir = make_tiny_llama(tmp_path_factory.mktemp("tiny") / "m", seed=2, vocab_size=259)
    make_tiny_tokenizer().save_pretrained(model_dir)
    served = Group(model_dir, http=True, extra=("--served-model-name", "tiny",
                                                "--max-model-len", "512"))
    pids = served.pids(ROLES)
    rss = {name: psutil.Process(pid).memory_info().rss for name, pid in pids.items()}
    yield served, pids, rss
    assert served.close() == 0


CASES = hostile_requests.cases("tiny", random.Random(38))


@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_request_is_refused_and_costs_the_group_nothing(group, case):
    served, pids, rss = group
    body, field = CASES[case]
    url = f"http://127.0.0.1:{served.port}/v1/chat/completions"
    start = time.monotonic()
    if isinstance(body, bytes):
        answer = httpx.post(url, content=body, timeout=60,
                            headers={"Content-Type": "application/json"})
    else:
        answer = httpx.post(url, json=body, timeout=60)
    took = time.monotonic() - start
    assert 400 <= answer.status_code < 500, (answer.status_code, answer.text[:300])
    message = answer.json()["error"]["message"]
    if field is not None:
        assert field in message, message
    print(f"{case}: {answer.status_code} in {took:.2f} s: {message[:120]}")
    assert served.pids(ROLES) == pids
    for name, pid in pids.items():
        grown = psutil.Process(pid).memory_info().rss - rss[name]
        assert grown < RSS_GROWTH_LIMIT, (name, grown)
    good = httpx.post(url, json=CHAT, timeout=60)
    assert good.status_code == 200, good.text
