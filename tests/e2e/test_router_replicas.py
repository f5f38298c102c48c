"""The router in front of two local replicas of the test model (`--data-parallel-size 2`):
200 ShareGPT requests all complete with one engine's greedy outputs, a chat's turns stay on one
replica and hit its prefix cache, API keys and rate limits, and a replica group SIGKILLed under
32 streams loses nothing."""
from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from e2e.router_group import Router, metric, scrape

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import sharegpt

pytestmark = pytest.mark.slow

OPEN, SLOW = "open-key", "slow-key"   # SLOW: 60 requests a minute, 2 at once
AUTH = {"Authorization": f"Bearer {OPEN}"}


@pytest.fixture(scope="module")
def router(model_dir):
    r = Router("--model", str(model_dir), "--data-parallel-size", "2", "--api-key", OPEN,
               "--api-key", f"{SLOW}:60", "--rate-limit-burst", "2")
    r.model = model_dir.name
    r.launchers()
    yield r
    assert r.close() == 0
    assert r.leftovers() == []


# 8 prompt tokens + 8 generated fit one KV block each: the 200 run in two waves on one replica's
# 136 blocks without preemption, in half the time that 16 prompt tokens take on this host
NUM_SHAREGPT, PROMPT_TOKENS, NUM_STREAMS = 200, 8, 32
GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
CLEAN_RUN: dict[str, str] = {}  # prompt -> the router's greedy text without faults, 32 of them


@pytest.fixture(scope="module")
def sharegpt_prompts(tokenizer) -> list[str]:
    """The first human turns of the first 200 ShareGPT conversations, each cut to its first 8
    tokens: real prompts at a cost the suite can pay."""
    return [tokenizer.decode(tokenizer.encode(p, add_special_tokens=False)[:PROMPT_TOKENS])
            for p, _ in sharegpt.first_turns(limit=NUM_SHAREGPT)]


async def _complete(client, url, prompt, headers=AUTH):
    r = await client.post(f"{url}/v1/completions", headers=headers,
                          json={"prompt": prompt, **GREEDY})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length", choice  # complete: all max_tokens generated
    return choice["text"]


def test_200_sharegpt_requests_complete_as_one_engine_answers_and_both_replicas_serve(
        router, sharegpt_prompts):
    """All 200 at once through the router, then all 200 at once to replica 0 alone."""
    prompts = sharegpt_prompts
    replica0, secret0 = router.replicas()[f"{router.model}/0"]

    limits = httpx.Limits(max_connections=None)  # all 200 at once, not httpx's default 100

    async def run(url, headers=AUTH):
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            return await asyncio.gather(*(_complete(client, url, p, headers) for p in prompts))

    routed = asyncio.run(run(router.base))
    assert routed == asyncio.run(run(replica0, secret0))
    samples = router.metrics()
    CLEAN_RUN.update(list(dict(zip(prompts, routed)).items())[:NUM_STREAMS])
    per_replica = [metric(samples, "router_requests_total", replica=f"{router.model}/{i}")
                   for i in range(2)]
    assert sum(per_replica) == NUM_SHAREGPT and min(per_replica) > 0, per_replica
    hits = metric(samples, "router_affinity_hits_total")
    assert hits > 0 and hits + metric(samples, "router_spills_total") == NUM_SHAREGPT


def test_a_three_turn_chat_stays_on_its_replica_and_hits_its_prefix_cache(router):
    replicas = router.replicas()
    urls = {rid: url for rid, (url, _) in replicas.items()}
    before = router.metrics()
    hits_before = {rid: metric(scrape(f"{url}/metrics", secret), "vllm:prefix_cache_hits_total")
                   for rid, (url, secret) in replicas.items()}
    messages = [{"role": "user", "content": "Tell me about the history of the bicycle, "
                 "from its invention to the present day."}]
    served_by = []
    for turn, question in enumerate(["And the first pedals?", "Who raced them first?", None]):
        counts = router.metrics()
        r = httpx.post(f"{router.base}/v1/chat/completions", headers=AUTH, timeout=300, json={
            "messages": messages, "max_tokens": 12, "temperature": 0})
        assert r.status_code == 200, r.text
        after = router.metrics()
        served_by += [rid for rid in urls
                      if metric(after, "router_requests_total", replica=rid)
                      > metric(counts, "router_requests_total", replica=rid)]
        if question:
            messages += [r.json()["choices"][0]["message"], {"role": "user", "content": question}]
    assert len(served_by) == 3 and len(set(served_by)) == 1, served_by
    home = served_by[0]
    hits = {rid: metric(scrape(f"{url}/metrics", secret), "vllm:prefix_cache_hits_total")
            - hits_before[rid] for rid, (url, secret) in replicas.items()}
    # turns 2 and 3 find at least turn 1's prompt (whole 16-token blocks) in the cache
    assert hits[home] >= 2 * 16, hits
    assert metric(router.metrics(), "router_spills_total") == metric(before, "router_spills_total")


def test_api_keys_and_a_rate_limit_answer_401_and_429_then_the_key_recovers(router):
    body = {"prompt": "Hi", "max_tokens": 1}
    url = f"{router.base}/v1/completions"
    assert httpx.post(url, json=body, timeout=60).status_code == 401
    assert httpx.post(url, json=body, timeout=60,
                      headers={"Authorization": "Bearer wrong"}).status_code == 401
    slow = {"Authorization": f"Bearer {SLOW}"}

    async def three_at_once():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(client.post(url, json=body, headers=slow)
                                          for _ in range(3)))

    statuses = asyncio.run(three_at_once())
    assert sorted(r.status_code for r in statuses) == [200, 200, 429]
    refused = next(r for r in statuses if r.status_code == 429)
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    wait = int(refused.headers["Retry-After"])
    assert 1 <= wait <= 2
    time.sleep(wait)
    assert httpx.post(url, json=body, headers=slow, timeout=120).status_code == 200
    assert httpx.post(url, json=body, headers=AUTH, timeout=120).status_code == 200  # unlimited
    assert metric(router.metrics(), "router_rejected_total", reason="rate_limited") == 1


async def _stream(client, base, prompt, progress, index):
    text = ""
    async with client.stream("POST", f"{base}/v1/completions", headers=AUTH,
                             json={"prompt": prompt, "stream": True, **GREEDY}) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            text += event["choices"][0]["text"]
            progress[index] += 1
    return text


def test_sigkill_of_a_replica_group_mid_stream_loses_nothing(router):
    """32 streams; once each has 2 chunks on average, the replica with the most tokens in
    flight is SIGKILLed whole: every stream completes as in the clean run."""
    if not CLEAN_RUN:
        pytest.skip("needs the clean run of test_200_sharegpt_requests_complete...")
    prompts = list(CLEAN_RUN)
    retries = metric(router.metrics(), "router_retries_total")

    async def run():
        progress = [0] * len(prompts)
        async with httpx.AsyncClient(timeout=300) as client:
            tasks = [asyncio.ensure_future(_stream(client, router.base, p, progress, i))
                     for i, p in enumerate(prompts)]
            while sum(progress) < 2 * len(prompts):
                await asyncio.sleep(0.02)
            killed = _kill_busiest_group(router)
            assert not all(t.done() for t in tasks)  # the kill hit streams in flight
            return await asyncio.gather(*tasks), killed

    texts, killed = asyncio.run(run())
    assert texts == [CLEAN_RUN[p] for p in prompts]
    assert not any(p.is_running() for p in killed)
    after = router.metrics()
    assert metric(after, "router_retries_total") > retries
    assert metric(after, "router_replica_restarts_total") == 1


def _kill_busiest_group(router: Router) -> list[psutil.Process]:
    """SIGKILL the launcher and every process of the replica with the most tokens in flight."""
    samples = router.metrics()
    busiest = max(router.replica_urls().items(), key=lambda item: metric(
        samples, "router_replica_outstanding_tokens", replica=item[0]))
    launcher = router.launcher_on(busiest[1])
    group = [launcher, *launcher.children(recursive=True)]
    for proc in group:
        proc.kill()
    psutil.wait_procs(group, timeout=10)
    return group
