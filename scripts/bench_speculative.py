"""N-gram speculative decoding, one request at a time (issue #26's benchmark): our server without
and with `--speculative-config`, started alone and alternating A/B for `--pairs` pairs (the
host is noisy), each warmed with one request, measured on two workloads, and stopped.

- `edit`: code-editing prompts that repeat their context (short Python functions below, each
  with an instruction to output the whole code again), max_tokens 256: where n-gram drafts hit.
- `sharegpt`: first turns of ShareGPT conversations (scripts/sharegpt.py), max_tokens 128: where
  they rarely do, so speculation must cost next to nothing.

Greedy, streamed chat requests, single stream. Per run and workload: output tokens, wall time,
output tok/s (sum of tokens / sum of request times), TPOT p50 ((end - first token) / (tokens -
1) per request), TTFT p50, and for speculative runs the acceptance read from /metrics (accepted
/ draft tokens, accepted per draft). Each pair also counts the prompts whose greedy token ids
are the same in both modes (they should all be). Speedup = speculative / baseline tok/s per
pair, median over pairs; the issue's targets: edit >= 1.5x, sharegpt >= 0.95x. Prints one JSON
object last; stored under benchmarks/results/ (scripts/bench_record.py) unless --no-store.

    .venv/bin/python scripts/bench_speculative.py                       # 2 pairs, 8 prompts each
    .venv/bin/python scripts/bench_speculative.py --pairs 1 --num-prompts 2 --max-tokens 16
"""
from __future__ import annotations

import argparse
import json
import shlex
import socket
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_record  # noqa: E402
from bench_serving import percentile  # noqa: E402
from compare_llama_server import Server, median  # noqa: E402
from llama_server_build import log  # noqa: E402

DEFAULT_SPEC = ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                '"prompt_lookup_min": 2}')
MAX_TOKENS = {"edit": 256, "sharegpt": 128}
SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")

FUNCTIONS = [
    ("def mean_price(items):\n    total = 0\n    count = 0\n    for item in items:\n"
     "        if item['price'] is None:\n            print('skipping', item['name'])\n"
     "            continue\n        total += item['price']\n        count += 1\n"
     "    if count == 0:\n        print('no prices')\n        return 0.0\n"
     "    print('mean of', count, 'prices')\n    return total / count\n"),
    ("def parse_config(path):\n    settings = {}\n    with open(path) as handle:\n"
     "        for number, line in enumerate(handle, 1):\n            line = line.strip()\n"
     "            if not line or line.startswith('#'):\n                continue\n"
     "            if '=' not in line:\n                print('bad line', number)\n"
     "                continue\n            key, value = line.split('=', 1)\n"
     "            settings[key.strip()] = value.strip()\n    return settings\n"),
    ("def merge_intervals(intervals):\n    intervals = sorted(intervals)\n    merged = []\n"
     "    for start, end in intervals:\n        if merged and start <= merged[-1][1]:\n"
     "            merged[-1][1] = max(merged[-1][1], end)\n        else:\n"
     "            merged.append([start, end])\n    return merged\n\n\n"
     "def total_length(intervals):\n    length = 0\n"
     "    for start, end in merge_intervals(intervals):\n"
     "        length += end - start\n    return length\n"),
    ("class Inventory:\n    def __init__(self):\n        self.stock = {}\n\n"
     "    def add(self, name, amount):\n"
     "        self.stock[name] = self.stock.get(name, 0) + amount\n"
     "        print('added', amount, name)\n\n    def remove(self, name, amount):\n"
     "        if self.stock.get(name, 0) < amount:\n            print('not enough', name)\n"
     "            return False\n        self.stock[name] -= amount\n        return True\n\n"
     "    def report(self):\n        for name, amount in sorted(self.stock.items()):\n"
     "            print(name, amount)\n"),
    ("def word_counts(text, min_length):\n    counts = {}\n"
     "    for word in text.lower().split():\n        word = word.strip('.,;:!?')\n"
     "        if len(word) < min_length:\n            continue\n"
     "        counts[word] = counts.get(word, 0) + 1\n    return counts\n\n\n"
     "def top_words(text, n):\n    counts = word_counts(text, 3)\n"
     "    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))\n"
     "    return ranked[:n]\n"),
    ("def retry(call, attempts, delay):\n    import time\n    last_error = None\n"
     "    for attempt in range(attempts):\n        try:\n            return call()\n"
     "        except Exception as error:\n            last_error = error\n"
     "            print('attempt', attempt, 'failed:', error)\n            time.sleep(delay)\n"
     "            delay = delay * 2\n    print('giving up after', attempts, 'attempts')\n"
     "    raise last_error\n"),
    ("def binary_search(values, target):\n    low = 0\n    high = len(values) - 1\n"
     "    while low <= high:\n        middle = (low + high) // 2\n"
     "        if values[middle] == target:\n            return middle\n"
     "        if values[middle] < target:\n            low = middle + 1\n        else:\n"
     "            high = middle - 1\n    return -1\n\n\ndef contains(values, target):\n"
     "    return binary_search(values, target) != -1\n"),
    ("def read_scores(rows):\n    scores = []\n    for row in rows:\n"
     "        name, score = row.split(',')\n        score = int(score)\n"
     "        if score < 0 or score > 100:\n            print('invalid score for', name)\n"
     "            continue\n        scores.append((name, score))\n    return scores\n\n\n"
     "def grade(score):\n    if score >= 90:\n        return 'A'\n    if score >= 75:\n"
     "        return 'B'\n    if score >= 50:\n        return 'C'\n    return 'F'\n"),
]
LOGGING = "Convert these print calls to logging calls and output the full code."
HINTS = "Add type hints to every function and output the whole file."
# One task per function, each asking for the whole code back (what n-gram drafts copy from).
TASKS = [LOGGING,
         "Rename `settings` to `options` everywhere in this code and output the full code.",
         HINTS, LOGGING,
         "Rename `counts` to `frequencies` everywhere in this code and output the full code.",
         "Add a docstring to every function and output the full code.", HINTS,
         "Rename `score` to `points` everywhere in this code and output the full code."]


def edit_prompts(n: int) -> list[str]:
    return [f"{TASKS[i % len(TASKS)]}\n\n```python\n{FUNCTIONS[i % len(FUNCTIONS)]}```"
            for i in range(n)]


def sharegpt_prompts(n: int, seed: int) -> list[str]:
    import sharegpt
    return [p[:2000] for p, _ in sharegpt.sample_first_turns(n, seed)]


def one_request(client: httpx.Client, base: str, model: str, prompt: str,
                max_tokens: int) -> dict:
    """Start, first-token and end times and the token ids of one greedy streamed chat request."""
    payload = {"model": model, "messages": [{"role": "user", "content": prompt}],
               "max_tokens": max_tokens, "temperature": 0, "stream": True,
               "return_token_ids": True}
    start, first, ids = time.perf_counter(), None, []
    with client.stream("POST", f"{base}/v1/chat/completions", json=payload) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices") or ():
                if choice.get("token_ids"):
                    first = first or time.perf_counter()
                    ids.extend(choice["token_ids"])
    return {"start": start, "first": first, "end": time.perf_counter(), "ids": ids}


def spec_counters(base: str) -> dict[str, float]:
    """The speculation counters of /metrics, summed over their labels (0 when absent)."""
    totals = dict.fromkeys(SPEC_COUNTERS, 0.0)
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0].removesuffix("_total")
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def measure(base: str, model: str, prompts: list[str], max_tokens: int) -> tuple[dict, list]:
    """One workload's figures on a running server, and each prompt's output token ids."""
    before = spec_counters(base)
    with httpx.Client(timeout=1800) as client:
        reqs = [one_request(client, base, model, p, max_tokens) for p in prompts]
    after = spec_counters(base)
    tokens = sum(len(r["ids"]) for r in reqs)
    busy = sum(r["end"] - r["start"] for r in reqs)
    ttft = [r["first"] - r["start"] for r in reqs if r["first"]]
    tpot = [(r["end"] - r["first"]) / (len(r["ids"]) - 1) for r in reqs if len(r["ids"]) > 1]
    drafts, draft_tokens, accepted = (after[k] - before[k] for k in SPEC_COUNTERS)
    figures = {"requests": len(reqs), "output_tokens": tokens,
               "wall_s": round(reqs[-1]["end"] - reqs[0]["start"], 3),
               "output_tok_s": round(tokens / busy, 2) if busy else 0.0,
               "tpot_ms_p50": round(1000 * percentile(tpot, 50), 2),
               "ttft_ms_p50": round(1000 * percentile(ttft, 50), 2),
               "drafts": int(drafts), "draft_tokens": int(draft_tokens),
               "accepted_tokens": int(accepted),
               "acceptance_rate": round(accepted / draft_tokens, 4) if draft_tokens else None,
               "accepted_per_draft": round(accepted / drafts, 3) if drafts else None}
    return figures, [r["ids"] for r in reqs]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_for(args, mode: str, logs: Path, pair: int) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "pagedserve.pipeline.launch", "--model", args.model,
           "--host", "127.0.0.1", "--port", str(port), "--cpu-threads", str(args.cpu_threads),
           "--die-with-parent", *shlex.split(args.our_args)]
    if mode == "speculative":
        cmd += ["--speculative-config", args.speculative_config]
    return Server(mode, cmd, port, logs / f"{mode}-{pair}.log")


def run_mode(args, mode: str, pair: int, workloads: dict, logs: Path) -> tuple[dict, dict]:
    """Start one server, warm it, measure every workload, stop it."""
    server = server_for(args, mode, logs, pair)
    figures, outputs = {}, {}
    try:
        server.start(args.start_timeout)
        model = httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["id"]
        with httpx.Client(timeout=600) as client:
            one_request(client, server.base_url, model, "Say hello.", 8)
        for name, (prompts, max_tokens) in workloads.items():
            figures[name], outputs[name] = measure(server.base_url, model, prompts, max_tokens)
            log(f"pair {pair} {mode} {name}: {figures[name]}")
    finally:
        stopped = server.stop()
    return {"pair": pair, "mode": mode, "stopped": stopped, **figures}, outputs


def summarize(runs: list[dict], same: dict[str, list[int]], workloads: dict) -> dict:
    summary = {}
    for name, (prompts, _) in workloads.items():
        by = {m: [r[name] for r in runs if r["mode"] == m] for m in ("baseline", "speculative")}
        per_pair = [round(s["output_tok_s"] / b["output_tok_s"], 3) if b["output_tok_s"] else None
                    for b, s in zip(by["baseline"], by["speculative"])]
        valid = [x for x in per_pair if x is not None]
        summary[name] = {
            "speedup": round(median(valid), 3) if valid else None, "speedup_per_pair": per_pair,
            **{f"{m}_{k}": round(median([f[k] for f in by[m]]), 2) for m in by
               for k in ("output_tok_s", "tpot_ms_p50", "ttft_ms_p50")},
            "acceptance_rate": median([f["acceptance_rate"] or 0.0 for f in by["speculative"]]),
            "accepted_per_draft": median([f["accepted_per_draft"] or 0.0
                                          for f in by["speculative"]]),
            "identical_outputs_per_pair": same[name], "prompts": len(prompts)}
    targets = {}
    if "edit" in summary:
        targets["edit_speedup_ge_1.5"] = (summary["edit"]["speedup"] or 0) >= 1.5
    if "sharegpt" in summary:
        targets["sharegpt_speedup_ge_0.95"] = (summary["sharegpt"]["speedup"] or 0) >= 0.95
    return {"summary": summary, "targets": targets}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--cpu-threads", type=int, default=2)
    ap.add_argument("--speculative-config", default=DEFAULT_SPEC)
    ap.add_argument("--our-args", default="", help="more server flags, e.g. '-q int8'")
    ap.add_argument("--pairs", type=int, default=2, help="rounds of baseline + speculative")
    ap.add_argument("--num-prompts", type=int, default=8, help="per workload")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="for both workloads (default: edit 256, sharegpt 128)")
    ap.add_argument("--workloads", nargs="+", choices=sorted(MAX_TOKENS),
                    default=["edit", "sharegpt"])
    ap.add_argument("--seed", type=int, default=0, help="the ShareGPT sample")
    ap.add_argument("--start-timeout", type=float, default=900.0)
    bench_record.add_no_store_flag(ap)
    return ap


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    json.loads(args.speculative_config)  # a typo fails here, not after the baseline run
    makers = {"edit": lambda: edit_prompts(args.num_prompts),
              "sharegpt": lambda: sharegpt_prompts(args.num_prompts, args.seed)}
    workloads = {w: (makers[w](), args.max_tokens or MAX_TOKENS[w])
                 for w in args.workloads}
    logs = Path(tempfile.mkdtemp(prefix="bench-speculative-"))
    log(f"server logs in {logs}")
    runs, same = [], {w: [] for w in workloads}
    for pair in range(args.pairs):
        order = ("baseline", "speculative") if pair % 2 == 0 else ("speculative", "baseline")
        outputs = {}
        for mode in order:
            run, outputs[mode] = run_mode(args, mode, pair, workloads, logs)
            runs.append(run)
        for w in workloads:
            same[w].append(sum(a == b for a, b in zip(outputs["baseline"][w],
                                                      outputs["speculative"][w])))
    report = {"model": args.model, "cpu_threads": args.cpu_threads, "our_args": args.our_args,
              "speculative_config": json.loads(args.speculative_config), "pairs": args.pairs,
              "num_prompts": args.num_prompts,
              "max_tokens": {w: mt for w, (_, mt) in workloads.items()}, "logs": str(logs),
              **summarize(runs, same, workloads), "runs": runs}
    bench_record.finish("bench_speculative", report, args.no_store, argv)
    return report


if __name__ == "__main__":
    main()
