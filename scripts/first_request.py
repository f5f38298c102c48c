"""The README's first request, as a newcomer sends it, N times: does the model answer well at its
own defaults?

Sends `{"model": M, "messages": [{"role": "user", "content": "What is the capital of France?"}]}`
(no max_tokens, no temperature: the model's generation defaults apply) --repeat times to a
running server (--base-url) or to a group this script launches for --model, and counts answers
that finish with `stop` and answers that mention Paris. Prints one JSON object last (stored under
benchmarks/results/first_request/ unless --no-store); exits 1 when fewer than --min-good answers
both stop and mention Paris.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_record  # noqa: E402

QUESTION = "What is the capital of France?"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(model: str, extra: list[str], timeout: float) -> tuple[subprocess.Popen, str]:
    """Start a group for `model` on a free loopback port; (launcher process, base URL)."""
    port = free_port()
    ipc_dir = tempfile.mkdtemp(prefix="pagedserve-first-")
    cmd = [sys.executable, "-m", "pagedserve.pipeline.launch", "--model", model,
           "--host", "127.0.0.1", "--port", str(port), "--ipc-dir", os.path.join(ipc_dir, "ipc"),
           "--die-with-parent", *extra]
    proc = subprocess.Popen(cmd, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the group for {model} exited with {proc.returncode} while starting")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop(proc)
    raise SystemExit(f"the group for {model} was not ready within {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


def ask(base: str, model: str, timeout: float) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": QUESTION}]}
    start = time.monotonic()
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=timeout)
    r.raise_for_status()
    data = r.json()
    choice = data["choices"][0]
    return {"text": choice["message"]["content"] or "", "finish_reason": choice["finish_reason"],
            "completion_tokens": data["usage"]["completion_tokens"],
            "seconds": time.monotonic() - start}


def summarize(model: str, answers: list[dict], min_good: int) -> dict:
    stopped = sum(a["finish_reason"] == "stop" for a in answers)
    paris = sum("paris" in a["text"].lower() for a in answers)
    good = sum(a["finish_reason"] == "stop" and "paris" in a["text"].lower() for a in answers)
    tokens = [a["completion_tokens"] for a in answers]
    return {"model": model, "question": QUESTION, "repeat": len(answers),
            "finish_stop": stopped, "mentions_paris": paris, "good": good,
            "min_good": min_good, "ok": good >= min_good,
            "completion_tokens_median": statistics.median(tokens), "completion_tokens_max": max(tokens),
            "seconds_median": round(statistics.median(a["seconds"] for a in answers), 2),
            "examples": [a["text"][:200] for a in answers[:3]]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a model to launch (default: the built-in "
                   "default), or the served name when --base-url is given")
    p.add_argument("--base-url", default=None, help="a running server instead of launching one")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--min-good", type=int, default=19)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--start-timeout", type=float, default=1800.0)
    p.add_argument("--launch-arg", action="append", default=[],
                   help="an extra flag for the launched group (repeatable)")
    bench_record.add_no_store_flag(p)
    args = p.parse_args(argv)
    proc, base = None, args.base_url
    if base is None:
        from pagedserve.workers.loader import DEFAULT_MODEL
        args.model = args.model or DEFAULT_MODEL
        proc, base = launch(args.model, args.launch_arg, args.start_timeout)
    try:
        model = args.model or httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
        with ThreadPoolExecutor(args.concurrency) as pool:
            answers = list(pool.map(lambda _: ask(base, model, args.timeout), range(args.repeat)))
    finally:
        if proc is not None:
            stop(proc)
    result = summarize(model, answers, args.min_good)
    bench_record.finish("first_request", result, args.no_store, argv)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
