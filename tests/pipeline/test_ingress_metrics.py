"""/metrics parses with prometheus_client's parser, uses vLLM's names, and moves as requests run."""
import asyncio

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.pipeline.ingress import build_app
from pagedserve.pipeline.ingress.testing import make_test_context

ISSUE_NAMES = {  # family names as the parser reports them (counters without _total)
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:num_requests_swapped",
    "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
    "vllm:num_preemptions", "vllm:prompt_tokens", "vllm:generation_tokens",
    "vllm:request_success", "vllm:time_to_first_token_seconds",
    "vllm:time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds", "vllm:iteration_tokens_total",
}


def samples(text: str) -> dict:
    """{(sample name, frozenset of labels): value}"""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(snap, name, **labels):
    return snap[(name, frozenset({"model_name": "tiny", **labels}.items()))]


def engine_stats(step: int) -> dict:
    return {"num_requests_running": 2 * step, "num_requests_waiting": step,
            "num_requests_swapped": 0, "kv_cache_usage_perc": 0.25 * step,
            "prefix_cache_queries": 100 * step, "prefix_cache_hits": 40 * step,
            "num_preemptions": step, "prompt_tokens": 500 * step, "generation_tokens": 70 * step,
            "iteration_tokens": {"buckets": [1, 8, 64], "counts": [step, 2 * step, 3 * step],
                                 "sum": 90.0 * step, "count": 3 * step}}


def test_metrics_parse_and_move():
    async def main():
        ctx, engine = make_test_context()
        engine.stats_result = engine_stats(0)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(ctx)),
                                     base_url="http://test") as client:
            r = await client.get("/metrics")
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
            before = samples(r.text)
            names = {f.name for f in text_string_to_metric_families(r.text)}
            assert ISSUE_NAMES <= names, ISSUE_NAMES - names

            await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
            await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4,
                                                       "stream": True, "n": 2})
            await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 9,
                                                       "stop": "h"})
            engine.stats_result = engine_stats(1)
            after = samples((await client.get("/metrics")).text)

        def moved(name, **labels):
            return value(after, name, **labels) - before.get(
                (name, frozenset({"model_name": "tiny", **labels}.items())), 0.0)

        assert moved("vllm:time_to_first_token_seconds_count") == 3
        assert moved("vllm:e2e_request_latency_seconds_count") == 3
        assert moved("vllm:request_queue_time_seconds_count") == 3
        # one observation per later token of each sample: 3 + 3 + 3 (n=2) ... + stop run
        assert moved("vllm:time_per_output_token_seconds_count") >= 9
        assert moved("vllm:request_success_total", finished_reason="length") == 3
        assert moved("vllm:request_success_total", finished_reason="stop") == 1
        assert value(after, "vllm:num_requests_running") == 2
        assert value(after, "vllm:num_requests_waiting") == 1
        assert value(after, "vllm:kv_cache_usage_perc") == 0.25
        assert moved("vllm:prompt_tokens_total") == 500
        assert moved("vllm:generation_tokens_total") == 70
        assert moved("vllm:prefix_cache_queries_total") == 100
        assert moved("vllm:prefix_cache_hits_total") == 40
        assert moved("vllm:num_preemptions_total") == 1
        assert value(after, "vllm:iteration_tokens_total_bucket", le="8.0") == 2
        assert value(after, "vllm:iteration_tokens_total_bucket", le="+Inf") == 3
        assert value(after, "vllm:iteration_tokens_total_sum") == 90.0
    asyncio.run(main())


def test_scheduler_queue_time_histogram_is_preferred_when_present():
    async def main():
        ctx, engine = make_test_context()
        engine.stats_result = {"request_queue_time": {"buckets": [0.5, 1.0], "counts": [4, 6],
                                                      "sum": 3.5, "count": 7}}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(ctx)),
                                     base_url="http://test") as client:
            await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1})
            snap = samples((await client.get("/metrics")).text)
        assert value(snap, "vllm:request_queue_time_seconds_count") == 7
        assert value(snap, "vllm:request_queue_time_seconds_bucket", le="0.5") == 4
    asyncio.run(main())


def test_metrics_still_served_when_the_engine_does_not_answer():
    async def main():
        ctx, engine = make_test_context()

        async def no_answer():
            raise TimeoutError("scheduler did not answer")
        engine.stats = no_answer
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(ctx)),
                                     base_url="http://test") as client:
            r = await client.get("/metrics")
        assert r.status_code == 200
        assert value(samples(r.text), "vllm:num_requests_running") == 0
    asyncio.run(main())


def test_speculation_metrics_appear_only_when_the_engine_speculates():
    async def main():
        ctx, engine = make_test_context()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(ctx)),
                                     base_url="http://test") as client:
            engine.stats_result = engine_stats(1)
            off = samples((await client.get("/metrics")).text)
            engine.stats_result = engine_stats(1) | {
                "spec_decode_num_drafts": 10, "spec_decode_num_draft_tokens": 40,
                "spec_decode_num_accepted_tokens": 25,
                "spec_decode_num_accepted_tokens_per_pos": [9, 7, 5, 4],
                "spec_decode_request_acceptance": {"buckets": [0.5, 1.0], "counts": [1, 3],
                                                   "sum": 2.1, "count": 3}}
            on = samples((await client.get("/metrics")).text)
        assert not any(name.startswith("vllm:spec_decode") for name, _ in off)
        assert value(on, "vllm:spec_decode_num_drafts_total") == 10
        assert value(on, "vllm:spec_decode_num_draft_tokens_total") == 40
        assert value(on, "vllm:spec_decode_num_accepted_tokens_total") == 25
        assert [value(on, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(p))
                for p in range(4)] == [9, 7, 5, 4]
        assert value(on, "pagedserve:spec_decode_request_acceptance_rate_count") == 3
        assert value(on, "pagedserve:spec_decode_request_acceptance_rate_bucket", le="0.5") == 1
    asyncio.run(main())
