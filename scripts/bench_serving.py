"""Serving benchmark: ShareGPT requests streamed over HTTP against a running OpenAI-compatible
server (pagedserve, vLLM, llama-server, ...).

Requests arrive as a Poisson process at --request-rate (or all at once with `inf`), with at most
--max-concurrency in flight. Each request streams; we time the first token (TTFT), the gaps
between streamed chunks (ITL), time per output token after the first (TPOT) and the whole
request (E2E), and count output tokens from the final `usage` chunk.

    scripts/launch.sh &                                   # serves on :8000
    .venv/bin/python scripts/bench_serving.py --num-prompts 200 --max-concurrency 64 \\
        --request-rate 2 4 8 inf --result-file bench.json --plot bench.png

Prints a table per rate; writes all results as JSON and, with several rates, a PNG of latency
and throughput against request rate. The last line is one JSON object: the last rate's
output_tok_s, ttft_ms_p50, ttft_ms_p99, tpot_ms_p50, ... plus `sweep` with every rate and
`config` (the arguments); it is stored under benchmarks/results/bench_serving/
(scripts/bench_record.py) unless --no-store.

The prompts are a seeded uniform sample of the whole ShareGPT file (--seed; see
sample_sharegpt), so every server measured with the same arguments gets the same requests.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_record  # noqa: E402


@dataclass(slots=True)
class BenchRequest:
    prompt: str
    prompt_len: int
    max_tokens: int


@dataclass(slots=True)
class RequestResult:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0          # seconds from send to the first streamed text
    e2e: float = 0.0           # seconds from send to the end of the stream
    itl: list[float] = field(default_factory=list)  # gaps between streamed chunks
    output_tokens: int = 0
    prompt_tokens: int = 0

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


# ------------------------------------------------------------------------------------ dataset

def load_tokenizer(name: str):
    if name == "none":
        return None
    from pagedserve.workers.loader import resolve_model
    from pagedserve.pipeline.tokenizer import load_tokenizer as load
    return load(resolve_model(name))


def count_tokens(tokenizer, text: str) -> int:
    if tokenizer is None:
        return max(1, len(text) // 4)  # rough: about 4 characters per token in English
    return len(tokenizer.encode(text, add_special_tokens=False))


def sample_sharegpt(num_prompts: int, tokenizer, *, max_output_tokens: int,
                    max_prompt_tokens: int, seed: int, dataset: str | None = None
                    ) -> list[BenchRequest]:
    """First turns of ShareGPT conversations: the human turn is the prompt, the length of the
    reply (capped at max_output_tokens) the number of tokens to generate. Candidates are a
    seeded uniform sample of max(8 N, 1000) first turns of the whole file
    (sharegpt.sample_first_turns), taken in that sample's order until N pass the filters."""
    import sharegpt

    pairs = sharegpt.sample_first_turns(max(num_prompts * 8, 1000), seed, dataset)
    requests = []
    for prompt, reply in pairs:
        prompt_len = count_tokens(tokenizer, prompt)
        output_len = min(count_tokens(tokenizer, reply), max_output_tokens)
        if prompt_len < 4 or output_len < 4 or prompt_len > max_prompt_tokens:
            continue  # the same filter vLLM's benchmark applies
        requests.append(BenchRequest(prompt, prompt_len, output_len))
        if len(requests) == num_prompts:
            break
    if len(requests) < num_prompts:
        print(f"note: only {len(requests)} ShareGPT prompts passed the filters", file=sys.stderr)
    return requests


# ---------------------------------------------------------------------------------- requests

def build_payload(req: BenchRequest, model: str, endpoint: str) -> dict:
    payload = {"model": model, "max_tokens": req.max_tokens, "stream": True,
               "stream_options": {"include_usage": True}, "temperature": 0.0,
               "ignore_eos": True}  # generate exactly max_tokens, so runs are comparable
    if endpoint == "chat":
        payload["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        payload["prompt"] = req.prompt
    return payload


def chunk_text(chunk: dict) -> str:
    text = ""
    for choice in chunk.get("choices") or ():
        if "text" in choice:
            text += choice.get("text") or ""
        else:
            text += (choice.get("delta") or {}).get("content") or ""
    return text


async def send_request(client: httpx.AsyncClient, url: str, payload: dict,
                       headers: dict[str, str]) -> RequestResult:
    result = RequestResult()
    start = time.perf_counter()
    last = start
    chunks_with_text = 0
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message"))
                    return result
                now = time.perf_counter()
                if chunk_text(chunk):
                    if chunks_with_text == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    chunks_with_text += 1
                    last = now
                usage = chunk.get("usage")
                if usage:
                    result.output_tokens = usage.get("completion_tokens", 0)
                    result.prompt_tokens = usage.get("prompt_tokens", 0)
        result.e2e = time.perf_counter() - start
        if not result.output_tokens:  # a server without usage in streams: count chunks
            result.output_tokens = chunks_with_text
        result.ok = chunks_with_text > 0
        if not result.ok:
            result.error = "the stream carried no text"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_rate(client: httpx.AsyncClient, url: str, model: str, endpoint: str,
                   requests: list[BenchRequest], rate: float, max_concurrency: int | None,
                   headers: dict[str, str], seed: int) -> tuple[list[RequestResult], float]:
    """Send every request with Poisson arrivals at `rate` per second (inf: all at once)."""
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    rng = random.Random(seed)

    async def one(req: BenchRequest) -> RequestResult:
        payload = build_payload(req, model, endpoint)
        if gate is None:
            return await send_request(client, url, payload, headers)
        async with gate:
            return await send_request(client, url, payload, headers)

    start = time.perf_counter()
    tasks = []
    for req in requests:
        tasks.append(asyncio.ensure_future(one(req)))
        if math.isfinite(rate):
            await asyncio.sleep(rng.expovariate(rate))
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


# ---------------------------------------------------------------------------------- summary

def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); 0.0 for no values."""
    if not values:
        return 0.0
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(results: list[RequestResult], duration: float, rate: float,
              max_concurrency: int | None) -> dict:
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    series = {"ttft": [r.ttft for r in done], "tpot": [t for r in done if (t := r.tpot) is not None],
              "itl": [x for r in done for x in r.itl], "e2e": [r.e2e for r in done]}
    summary = {"request_rate": rate if math.isfinite(rate) else "inf",
               "max_concurrency": max_concurrency, "completed": len(done),
               "failed": len(results) - len(done), "duration_s": round(duration, 3),
               "req_s": round(len(done) / duration, 3) if duration else 0.0,
               "output_tok_s": round(out_tokens / duration, 2) if duration else 0.0,
               "total_tok_s": round((in_tokens + out_tokens) / duration, 2) if duration else 0.0,
               "input_tokens": in_tokens, "output_tokens": out_tokens}
    for name, values in series.items():
        summary[f"{name}_ms_mean"] = round(1000 * sum(values) / len(values), 2) if values else 0.0
        for q in (50, 90, 99):
            summary[f"{name}_ms_p{q}"] = round(1000 * percentile(values, q), 2)
    errors = [r.error for r in results if not r.ok]
    if errors:
        summary["first_errors"] = errors[:3]
    return summary


def print_table(s: dict) -> None:
    print(f"\n== request rate {s['request_rate']} req/s, max concurrency "
          f"{s['max_concurrency'] or 'unlimited'} ==")
    print(f"completed {s['completed']}  failed {s['failed']}  duration {s['duration_s']} s")
    print(f"throughput {s['req_s']} req/s  {s['output_tok_s']} output tok/s  "
          f"{s['total_tok_s']} total tok/s")
    print(f"{'ms':>6} {'mean':>9} {'p50':>9} {'p90':>9} {'p99':>9}")
    for name in ("ttft", "tpot", "itl", "e2e"):
        print(f"{name:>6} " + " ".join(f"{s[f'{name}_ms_{k}']:>9.1f}"
                                        for k in ("mean", "p50", "p90", "p99")))
    for err in s.get("first_errors", []):
        print(f"error: {err}")


def plot(summaries: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [str(s["request_rate"]) for s in summaries]
    xs = range(len(summaries))
    fig, (lat, thr) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label in (("ttft_ms_p50", "TTFT p50"), ("ttft_ms_p99", "TTFT p99"),
                       ("tpot_ms_p50", "TPOT p50"), ("itl_ms_p99", "ITL p99")):
        lat.plot(xs, [s[key] for s in summaries], marker="o", label=label)
    lat.set_yscale("log")
    lat.set_ylabel("latency (ms)")
    thr.plot(xs, [s["output_tok_s"] for s in summaries], marker="o", label="output tok/s")
    thr.set_ylabel("output tokens/s")
    e2e = thr.twinx()
    e2e.plot(xs, [s["e2e_ms_p50"] / 1000 for s in summaries], marker="s", color="tab:red",
             label="E2E p50 (s)")
    e2e.set_ylabel("E2E p50 (s)")
    for ax in (lat, thr):
        ax.set_xticks(list(xs), labels)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
    lat.legend()
    thr.legend(loc="upper left")
    e2e.legend(loc="lower right")
    fig.suptitle(f"pagedserve serving benchmark (max concurrency "
                 f"{summaries[0]['max_concurrency'] or 'unlimited'})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ------------------------------------------------------------------------------------- main

def parse_rate(text: str) -> float:
    return math.inf if text.lower() in ("inf", "infinity") else float(text)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    ap.add_argument("--model", default=None, help="default: the first of GET /v1/models")
    ap.add_argument("--tokenizer", default="SmolLM2-135M-Instruct",
                    help="to measure ShareGPT lengths (a model name or directory; 'none': "
                         "estimate 4 characters per token)")
    ap.add_argument("--dataset", default=None, help="ShareGPT JSON file (default: fetched)")
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--request-rate", type=parse_rate, nargs="+", default=[math.inf],
                    help="requests per second, Poisson arrivals; inf sends all at once")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--max-output-tokens", type=int, default=256)
    ap.add_argument("--max-prompt-tokens", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY")
                    or os.environ.get("OPENAI_API_KEY"))
    ap.add_argument("--wait-ready", type=float, default=0.0,
                    help="poll /health for up to this many seconds before starting")
    ap.add_argument("--result-file", default="bench_serving.json")
    ap.add_argument("--plot", default="bench_serving.png", help="written when several rates run")
    bench_record.add_no_store_flag(ap)
    return ap


async def wait_ready(client: httpx.AsyncClient, base_url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if (await client.get(f"{base_url}/health")).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{base_url}/health did not answer 200 within {timeout:.0f}s")
        await asyncio.sleep(1.0)


async def main_async(args: argparse.Namespace) -> list[dict]:
    requests = sample_sharegpt(args.num_prompts, load_tokenizer(args.tokenizer),
                               max_output_tokens=args.max_output_tokens,
                               max_prompt_tokens=args.max_prompt_tokens, seed=args.seed,
                               dataset=args.dataset)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency or len(requests) or 1,
                          max_keepalive_connections=args.max_concurrency or 100)
    base = args.base_url.rstrip("/")
    url = f"{base}/v1/chat/completions" if args.endpoint == "chat" else f"{base}/v1/completions"
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0), limits=limits) as client:
        if args.wait_ready:
            await wait_ready(client, base, args.wait_ready)
        model = args.model
        if model is None:
            listing = await client.get(f"{base}/v1/models", headers=headers)
            listing.raise_for_status()
            model = listing.json()["data"][0]["id"]
        summaries = []
        for rate in args.request_rate:
            results, duration = await run_rate(client, url, model, args.endpoint, requests, rate,
                                               args.max_concurrency, headers, args.seed)
            summary = summarize(results, duration, rate, args.max_concurrency)
            summary["model"] = model
            print_table(summary)
            summaries.append(summary)
    return summaries


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    summaries = asyncio.run(main_async(args))
    config = {k: (v if not isinstance(v, float) or math.isfinite(v) else "inf")
              for k, v in vars(args).items() if k != "api_key"}
    config["request_rate"] = [r if math.isfinite(r) else "inf" for r in args.request_rate]
    Path(args.result_file).write_text(json.dumps({"config": config, "results": summaries},
                                                 indent=2))
    if len(summaries) > 1 and args.plot:
        plot(summaries, args.plot)
        print(f"plot: {args.plot}")
    print(f"results: {args.result_file}")
    result = {**summaries[-1], "sweep": summaries, "config": config}
    bench_record.finish("bench_serving", result, args.no_store, argv)
    return result


if __name__ == "__main__":
    main()
