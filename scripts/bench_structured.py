"""Structured output under load: N concurrent ShareGPT-prompted chat requests, each with its own
never-seen JSON schema, against the same requests unconstrained, on one launched group.

Reports output tok/s of both runs and their ratio, TTFT p50/p99 of both and their ratio, and the
grammar compile time distribution (the scheduler's GrammarCompiler). Each run is a fresh batch of
streams started together; the schemas carry a per-run nonce in their property names, so no
compiled grammar is reused. Prefix caching is off: both runs send the same prompts, and the
second would otherwise skip their prefill. Prints one JSON object last; stored under benchmarks/results/
(scripts/bench_record.py) unless --no-store.

    python scripts/bench_structured.py --model SmolLM2-135M-Instruct --num-prompts 64
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_record  # noqa: E402


def schema_for(i: int, nonce: str) -> dict:
    """A distinct, bounded schema per request: nested object, array, enum, numeric bounds."""
    return {"type": "object", "properties": {
        f"title_{nonce}_{i}": {"type": "string", "maxLength": 40},
        "score": {"type": "integer", "minimum": 0, "maximum": 100},
        "mood": {"enum": ["happy", "sad", "neutral", f"m{i}"]},
        "facts": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 30}},
        "meta": {"type": "object", "properties": {"lang": {"type": "string", "maxLength": 8},
                                                  "count": {"type": "integer", "minimum": 0}},
                 "required": ["lang", "count"]}},
        "required": [f"title_{nonce}_{i}", "score", "mood", "facts", "meta"]}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))] if ordered else float("nan")


async def one(client: httpx.AsyncClient, url: str, payload: dict) -> tuple[float, int, float]:
    """(TTFT, completion tokens, end time) of one streamed chat request."""
    start = time.perf_counter()
    ttft, tokens = None, 0
    async with client.stream("POST", url, json=payload) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if ttft is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - start
    return ttft if ttft is not None else float("nan"), tokens, time.perf_counter()


async def run(base: str, model: str, prompts: list[str], max_tokens: int, nonce: str | None) -> dict:
    payloads = []
    for i, prompt in enumerate(prompts):
        p = {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": True,
             "stream_options": {"include_usage": True}, "max_tokens": max_tokens, "temperature": 0}
        if nonce is not None:
            p["response_format"] = {"type": "json_schema",
                                    "json_schema": {"name": f"s{i}", "schema": schema_for(i, nonce)}}
        payloads.append(p)
    async with httpx.AsyncClient(timeout=1800, limits=httpx.Limits(max_connections=len(prompts))) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(one(client, f"{base}/v1/chat/completions", p) for p in payloads))
    elapsed = max(r[2] for r in results) - start
    ttfts = [r[0] for r in results]
    tokens = sum(r[1] for r in results)
    return {"output_tokens": tokens, "seconds": round(elapsed, 3),
            "output_tok_s": round(tokens / elapsed, 2),
            "ttft_p50_s": round(percentile(ttfts, 50), 3), "ttft_p99_s": round(percentile(ttfts, 99), 3)}


def launch(args) -> tuple[subprocess.Popen, str, str]:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ipc = os.path.join(tempfile.mkdtemp(prefix="bench-structured-"), "ipc")
    cmd = [sys.executable, "-m", "pagedserve.pipeline.launch", "--model", args.model,
           "--port", str(port), "--ipc-dir", ipc, "--max-num-seqs", str(max(64, args.num_prompts)),
           "--die-with-parent", "--no-enable-prefix-caching", *args.engine_args]
    proc = subprocess.Popen(cmd, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return proc, base, ipc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("the group did not come up")
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine-args", nargs=argparse.REMAINDER, default=[],
                    help="passed on to the launcher (last on the command line)")
    bench_record.add_no_store_flag(ap)
    args = ap.parse_args(argv)
    import sharegpt
    prompts = [p[:2000] for p, _ in sharegpt.sample_first_turns(args.num_prompts, args.seed)]
    proc, base, ipc = launch(args)
    try:
        model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        asyncio.run(run(base, model, prompts[:4], 8, None))  # warm-up
        plain = asyncio.run(run(base, model, prompts, args.max_tokens, None))
        constrained = asyncio.run(run(base, model, prompts, args.max_tokens, f"n{int(time.time())}"))
        from pagedserve.pipeline.client import EngineClient
        client = EngineClient(f"ipc://{ipc}/frontend.sock", f"ipc://{ipc}/output.sock")
        compile_s = client.stats()["grammar_compile_s"]
        client.close()
    finally:
        proc.terminate()
        proc.wait(120)
    result = {
        "model": args.model, "num_prompts": len(prompts), "max_tokens": args.max_tokens,
        "unconstrained": plain, "json_schema": constrained,
        "tok_s_ratio": round(constrained["output_tok_s"] / plain["output_tok_s"], 3),
        "ttft_p99_ratio": round(constrained["ttft_p99_s"] / plain["ttft_p99_s"], 3),
        "grammar_compile_ms": {"count": len(compile_s),
                               **{f"p{q}": round(1000 * percentile(compile_s, q), 2) for q in (50, 90, 99)},
                               "max": round(1000 * max(compile_s, default=float("nan")), 2)},
    }
    bench_record.finish("bench_structured", result, args.no_store, argv)
    return result


if __name__ == "__main__":
    main()
