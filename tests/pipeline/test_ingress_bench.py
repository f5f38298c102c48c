"""scripts/bench_serving.py speaks the ingress's streaming API (checked in-process against a
fake engine) and summarizes what it measured."""
import asyncio
import json
import math

import httpx
import pytest

from script_module import load_script

from pagedserve.pipeline.ingress import build_app
from pagedserve.pipeline.ingress.testing import make_test_context

bench = load_script("bench_serving")


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bench_measures_streams_against_the_app(endpoint):
    async def main():
        ctx, engine = make_test_context(max_model_len=256, step_delay=0.001)
        requests = [bench.BenchRequest("Hello there", 11, 5), bench.BenchRequest("Hi", 2, 8)]
        url = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(ctx)),
                                     base_url="http://test") as client:
            results, duration = await bench.run_rate(client, url, "tiny", endpoint, requests,
                                                     rate=50.0, max_concurrency=1, headers={},
                                                     seed=0)
        assert [r.ok for r in results] == [True, True], [r.error for r in results]
        assert [r.output_tokens for r in results] == [5, 8]  # from the usage chunk
        assert all(s.params.ignore_eos and s.params.max_tokens in (5, 8) for s in engine.submitted)
        assert all(0 < r.ttft <= r.e2e for r in results)
        assert [len(r.itl) for r in results] == [4, 7]
        s = bench.summarize(results, duration, 50.0, 1)
        assert s["completed"] == 2 and s["failed"] == 0 and s["output_tokens"] == 13
        assert s["output_tok_s"] == pytest.approx(13 / duration, rel=0.01)
        assert s["ttft_ms_p50"] <= s["ttft_ms_p99"]
        assert {"output_tok_s", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50"} <= s.keys()
    asyncio.run(main())


def test_bench_reports_http_errors():
    async def main():
        ctx, engine = make_test_context(api_key="k")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(ctx)),
                                     base_url="http://test") as client:
            r = await bench.send_request(client, "/v1/completions",
                                         bench.build_payload(bench.BenchRequest("x", 1, 2),
                                                             "tiny", "completions"), {})
        assert not r.ok and r.error.startswith("HTTP 401")
        s = bench.summarize([r], 1.0, math.inf, None)
        assert s["failed"] == 1 and s["request_rate"] == "inf" and s["output_tok_s"] == 0
    asyncio.run(main())


def test_percentile_interpolates():
    assert bench.percentile([], 50) == 0.0
    assert bench.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert bench.percentile([0.0, 10.0], 90) == pytest.approx(9.0)


def test_plot_and_json_of_a_sweep(tmp_path):
    r = bench.RequestResult(ok=True, ttft=0.1, e2e=0.5, itl=[0.1] * 4, output_tokens=5)
    sweep = [bench.summarize([r], 1.0, rate, 4) for rate in (1.0, 2.0, math.inf)]
    bench.plot(sweep, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000
    json.dumps(sweep)  # serializable, inf written as "inf"
