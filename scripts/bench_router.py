"""The router on this machine, two measurements (scripts, not tests):

1. **Scale-out**: 2 replicas x 1 core (the router, `--data-parallel-size 2 --cpu-threads 1`)
   against 1 replica x 2 cores (one group, `--cpu-threads 2`) on the same ShareGPT first turns,
   all sent at once: output tokens/s and TTFT.
2. **Affinity**: ShareGPT conversations replayed turn by turn (each turn's prompt is the
   conversation so far, with the data set's own replies, so both runs send the same prompts)
   through 2 replicas with `--routing affinity` against `--routing round-robin`: the replicas'
   prefix-cache hit rate (vllm:prefix_cache_hits / queries) and TTFT p50/p99 of the later turns.

    python scripts/bench_router.py --num-prompts 32 --conversations 12 --turns 3

Prints one JSON object last and stores it under benchmarks/results/bench_router/
(scripts/bench_record.py) unless --no-store.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_record  # noqa: E402
import bench_serving  # noqa: E402
import sharegpt  # noqa: E402

ENGINE = ("--dtype", "float32", "--kv-cache-memory", "256MiB", "--swap-space", "0.1")


class Server:
    """`python -m pagedserve.pipeline.launch FLAGS` on a free port, stopped on exit."""

    def __init__(self, model: str, *flags: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        self.tmp = tempfile.mkdtemp(prefix="pagedserve-bench-router-")
        cmd = [sys.executable, "-m", "pagedserve.pipeline.launch", "--model", model, *flags,
               *ENGINE, "--host", "127.0.0.1", "--port", str(self.port), "--die-with-parent"]
        if "--data-parallel-size" not in flags:
            cmd += ["--ipc-dir", os.path.join(self.tmp, "ipc")]
        self.proc = subprocess.Popen(cmd, env=dict(os.environ, TMPDIR=self.tmp),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def __enter__(self) -> "Server":
        deadline = time.monotonic() + 900
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}")
            try:
                if httpx.get(f"{self.base}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not start in 900 s")
            time.sleep(0.5)

    def __exit__(self, *exc) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(300)
        shutil.rmtree(self.tmp, ignore_errors=True)  # empty unless a group left something

    def engines(self) -> list[tuple[str, dict[str, str]]]:
        """(URL, headers) of each replica the router started, or this server itself. The router
        shows no replica URL, and a replica answers /metrics only with the secret the router
        gave it: both are read from its groups' launchers' command lines and the 0600 secret
        files in their private folders (ours: we started the router)."""
        from pagedserve.pipeline.config import REPLICA_SECRET_HEADER
        from pagedserve.private_files import read_private
        found = []
        for child in psutil.Process(self.proc.pid).children():
            try:
                cmd = child.cmdline()
            except psutil.Error:
                continue
            if "pagedserve.pipeline.launch" not in cmd or "--replica-secret-file" not in cmd:
                continue
            secret = read_private(cmd[cmd.index("--replica-secret-file") + 1],
                                  "--replica-secret-file").strip()
            found.append((f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}",
                          {REPLICA_SECRET_HEADER: secret}))
        return found or [(self.base, {})]


def _families(url: str, headers: dict[str, str] | None = None):
    resp = httpx.get(url, headers=headers, timeout=10)
    resp.raise_for_status()  # a replica without its secret answers 401: never count that as 0
    return list(text_string_to_metric_families(resp.text))


def prefix_counts(engines: list[tuple[str, dict[str, str]]]) -> tuple[float, float]:
    """(hits, queries) of the prefix cache, summed over the engines."""
    hits = queries = 0.0
    for url, headers in engines:
        for family in _families(f"{url}/metrics", headers):
            for s in family.samples:
                if s.name == "vllm:prefix_cache_hits_total":
                    hits += s.value
                elif s.name == "vllm:prefix_cache_queries_total":
                    queries += s.value
    return hits, queries


# -- 1. scale-out -------------------------------------------------------------------------------
async def _shoot(base: str, model: str, requests) -> dict:
    async with httpx.AsyncClient(timeout=1800) as client:
        results, duration = await bench_serving.run_rate(
            client, f"{base}/v1/completions", os.path.basename(model), "completions", requests,
            float("inf"),
            None, {}, seed=0)
    s = bench_serving.summarize(results, duration, float("inf"), None)
    return {k: s[k] for k in ("completed", "failed", "duration_s", "output_tok_s", "ttft_ms_p50",
                              "ttft_ms_p99", "tpot_ms_p50")}


def scale_out(args, model: str, tokenizer) -> dict:
    requests = bench_serving.sample_sharegpt(args.num_prompts, tokenizer,
                                             max_output_tokens=args.max_output_tokens,
                                             max_prompt_tokens=args.max_prompt_tokens, seed=0)
    out = {"num_prompts": len(requests)}
    with Server(model, "--data-parallel-size", "2", "--cpu-threads", "1") as server:
        out["2_replicas_x_1_core"] = asyncio.run(_shoot(server.base, model, requests))
    with Server(model, "--cpu-threads", "2") as server:
        out["1_replica_x_2_cores"] = asyncio.run(_shoot(server.base, model, requests))
    return out


# -- 2. multi-turn affinity ---------------------------------------------------------------------
def conversations(count: int, turns: int, max_chars: int, seed: int) -> list[list[tuple[str, str]]]:
    """`count` ShareGPT conversations with at least `turns` (human, gpt) pairs, each text cut
    to `max_chars`, drawn with a seeded reservoir from the whole file."""
    rng = random.Random(seed)
    picked: list[list[tuple[str, str]]] = []
    seen = 0
    for entry in sharegpt.iter_entries():
        msgs = entry.get("conversations") or []
        pairs = [(msgs[i].get("value") or "", msgs[i + 1].get("value") or "")
                 for i in range(0, 2 * turns, 2) if i + 1 < len(msgs)
                 and msgs[i].get("from") == "human" and msgs[i + 1].get("from") == "gpt"]
        if len(pairs) < turns or not all(h.strip() and g.strip() for h, g in pairs):
            continue
        pairs = [(h[:max_chars], g[:max_chars]) for h, g in pairs]
        if seen < count:
            picked.append(pairs)
        elif (slot := rng.randrange(seen + 1)) < count:
            picked[slot] = pairs
        seen += 1
    rng.shuffle(picked)
    return picked


async def _replay(base: str, model: str, convs, max_tokens: int) -> dict[int, list[float]]:
    """Every conversation's turns in order, conversations at once; TTFT by turn number."""
    ttft: dict[int, list[float]] = {}

    async def one(client, pairs):
        history = []
        for turn, (human, gpt) in enumerate(pairs):
            history.append({"role": "user", "content": human})
            payload = {"model": os.path.basename(model), "messages": list(history),
                       "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "ignore_eos": True}
            result = await bench_serving.send_request(
                client, f"{base}/v1/chat/completions", payload, {})
            if not result.ok:
                raise RuntimeError(f"turn {turn} failed: {result.error}")
            ttft.setdefault(turn, []).append(result.ttft)
            history.append({"role": "assistant", "content": gpt})

    async with httpx.AsyncClient(timeout=1800) as client:
        await asyncio.gather(*(one(client, pairs) for pairs in convs))
    return ttft


def affinity(args, model: str) -> dict:
    convs = conversations(args.conversations, args.turns, args.max_turn_chars, seed=0)
    out = {"conversations": len(convs), "turns": args.turns, "router_args": args.router_args}
    for routing in args.policies.split(","):
        with Server(model, "--data-parallel-size", "2", "--routing", routing,
                    *args.router_args.split()) as server:
            engines = server.engines()
            hits0, queries0 = prefix_counts(engines)
            ttft = asyncio.run(_replay(server.base, model, convs, args.max_output_tokens_turn))
            hits, queries = prefix_counts(engines)
        later = [t for turn, ts in ttft.items() if turn > 0 for t in ts]
        out[routing] = {
            "prefix_hit_rate": round((hits - hits0) / max(1.0, queries - queries0), 4),
            "ttft_ms_p50_later_turns": round(1000 * bench_serving.percentile(later, 50), 1),
            "ttft_ms_p99_later_turns": round(1000 * bench_serving.percentile(later, 99), 1),
            "ttft_ms_p50_all": round(1000 * bench_serving.percentile(
                [t for ts in ttft.values() for t in ts], 50), 1)}
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-output-tokens", type=int, default=32)
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-turn-chars", type=int, default=600)
    ap.add_argument("--max-output-tokens-turn", type=int, default=8)
    ap.add_argument("--skip", choices=("scale-out", "affinity"), default=None)
    ap.add_argument("--router-args", default="",
                    help="more router flags for the multi-turn runs, e.g. '--load-floor 512'")
    ap.add_argument("--policies", default="affinity,round-robin",
                    help="the routings compared, in this order (on a shared host, swap it)")
    bench_record.add_no_store_flag(ap)
    args = ap.parse_args(argv)
    from pagedserve.workers.loader import resolve_model
    model_dir = str(resolve_model(args.model))
    result = {"model": args.model}
    if args.skip != "scale-out":
        result["scale_out"] = scale_out(args, model_dir,
                                        bench_serving.load_tokenizer(args.model))
    if args.skip != "affinity":
        result["multi_turn"] = affinity(args, model_dir)
    bench_record.finish("bench_router", result, args.no_store, argv)
    return result


if __name__ == "__main__":
    main()
