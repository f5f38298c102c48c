"""Chaos soak: concurrent streams while a random role is killed or frozen every 10-40 s.

    .venv/bin/python scripts/chaos_soak.py --duration 600 --streams 48
    .venv/bin/python scripts/chaos_soak.py --duration 60 --streams 16 --interval 8 15  # short

A group (scheduler, --tensor-parallel-size workers, detokenizer, HTTP ingress) serves the
default model. First every request of the workload runs once without faults: the reference
(greedy, ignore_eos, so a request's tokens are fixed). Then for --duration seconds `--streams`
requests stay in flight through the ZMQ client library (which survives every restart), a few
more go over HTTP (retried when a restart drops their connection), and every `--interval`
seconds a random role - any worker rank, the scheduler, the detokenizer or the ingress - gets
SIGKILL, or SIGSTOP (the launcher must notice the silence: heartbeats, --step-timeout).

Printed last, one JSON object: requests completed; lost (failed or never answered: must be 0);
duplicated tokens (a stream's token offsets that overlap: must be 0); outputs differing from
the reference (must be 0); recovery time per fault (from the signal to the role's new process
back and the group healthy again: p50/p99/max); and the group's RSS, shared-memory
segments and open file descriptors after warm-up against the end.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

from pagedserve.lifecycle import stop_process_group
from pagedserve.pipeline import SamplingParams
from pagedserve.pipeline.client import EngineClient
from pagedserve.pipeline.outputs import RequestError

TOPICS = ["the sea", "mountains", "a robot", "bread", "the moon", "rivers", "chess", "winter",
          "a library", "trains", "coffee", "bees", "volcanoes", "music", "a garden", "clocks"]


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SoakGroup:
    """The group under test: its launcher, a ZMQ client, its role processes."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.ipc_dir = tempfile.mkdtemp(prefix="pagedserve-")
        self.port = free_port()
        cmd = [sys.executable, "-m", "pagedserve.pipeline.launch", "--model", args.model,
               "--dtype", args.dtype, "--kv-cache-memory", args.kv_cache_memory,
               "--tensor-parallel-size", str(args.tp), "--ipc-dir", self.ipc_dir,
               "--port", str(self.port), "--host", "127.0.0.1",
               "--step-timeout", str(args.step_timeout), "--heartbeat-timeout",
               str(args.heartbeat_timeout), "--max-restarts", "1000", "--die-with-parent"]
        self.proc = subprocess.Popen(cmd, start_new_session=True)
        self.client = EngineClient(f"ipc://{self.ipc_dir}/frontend.sock",
                                   f"ipc://{self.ipc_dir}/output.sock", connect_timeout=900)
        self.base = f"http://127.0.0.1:{self.port}"
        self.roles = [f"worker{r}" for r in range(args.tp)] + ["scheduler", "detokenizer",
                                                                "ingress"]
        self.wait_ready(900)

    def processes(self) -> dict[str, psutil.Process]:
        found = {}
        for child in psutil.Process(self.proc.pid).children():
            try:
                name = child.environ().get("PAGEDSERVE_ROLE")
            except psutil.Error:
                continue
            if name:
                found[name] = child
        return found

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the group exited with {self.proc.returncode}")
            try:
                if self.client.health(timeout=2) and httpx.get(
                        f"{self.base}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the group did not become ready")
            time.sleep(0.1)

    def resources(self) -> dict:
        procs = [psutil.Process(self.proc.pid), *self.processes().values()]
        rss = fds = 0
        for p in procs:
            try:
                rss += p.memory_info().rss
                fds += p.num_fds()
            except psutil.Error:
                pass
        tag = os.path.basename(self.ipc_dir)
        shm = sorted(n for n in os.listdir("/dev/shm") if n.startswith(tag))
        return {"rss_mib": round(rss / 2**20, 1), "fds": fds, "shm_segments": len(shm),
                "processes": len(procs)}

    def close(self) -> int:
        self.client.close()
        return stop_process_group(self.proc, 180)


def workload(tokenizer, num: int, rng: random.Random,
             lengths: tuple[int, int] = (16, 96)) -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens) pairs: short prompts, outputs of `lengths` tokens."""
    out = []
    for i in range(num):
        topic = TOPICS[i % len(TOPICS)]
        text = (f"Write a few sentences about {topic}." if i % 2 else
                f"Q: What do you know about {topic}? Answer in detail.\nA:")
        out.append((tokenizer.encode(text), rng.randint(*lengths)))
    return out


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


class Streams:
    """Keeps `width` requests of the workload in flight and checks every finished one."""

    def __init__(self, group: SoakGroup, work, reference, width: int, rng: random.Random):
        self.group, self.work, self.reference, self.rng = group, work, reference, rng
        self.width = width
        self.completed = self.lost = self.differing = self.duplicated = 0
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()

    def run_one(self) -> None:
        while not self.stop.is_set():
            index = self.rng.randrange(len(self.work))
            prompt, max_tokens = self.work[index]
            tokens: list[int] = []
            try:
                for delta in self.group.client.generate(prompt, greedy(max_tokens)):
                    if delta.token_offset != len(tokens):
                        with self.lock:
                            self.duplicated += max(0, len(tokens) - delta.token_offset)
                    tokens.extend(delta.token_ids)
            except RequestError as exc:
                with self.lock:
                    self.lost += 1
                    self.errors.append(f"{exc.status}: {exc.message}"[:200])
                continue
            with self.lock:
                self.completed += 1
                if tokens != self.reference[index]:
                    self.differing += 1

    def start(self) -> list[threading.Thread]:
        threads = [threading.Thread(target=self.run_one, daemon=True) for _ in range(self.width)]
        for t in threads:
            t.start()
        return threads


class HttpProbe:
    """A few completions over HTTP, each retried until served: a lost one never succeeds."""

    def __init__(self, base: str, model: str, width: int = 2) -> None:
        self.base, self.model, self.width = base, model, width
        self.completed = self.lost = self.server_errors = 0
        self.stop = threading.Event()

    def run_one(self) -> None:
        body = {"model": self.model, "prompt": "Name three colors:", "max_tokens": 8,
                "temperature": 0}
        while not self.stop.is_set():
            deadline = time.monotonic() + 120
            while True:
                try:
                    r = httpx.post(f"{self.base}/v1/completions", json=body, timeout=60)
                    if r.status_code == 200:
                        self.completed += 1
                        break
                    if r.status_code >= 500 and r.status_code != 503:
                        self.server_errors += 1
                except httpx.HTTPError:
                    pass  # the ingress restarting: retry
                if time.monotonic() > deadline or self.stop.is_set():
                    self.lost += not self.stop.is_set()
                    break
                time.sleep(0.5)

    def start(self) -> list[threading.Thread]:
        threads = [threading.Thread(target=self.run_one, daemon=True) for _ in range(self.width)]
        for t in threads:
            t.start()
        return threads


def inject(group: SoakGroup, rng: random.Random, stop_share: float) -> tuple[str, str, float]:
    """Kill or freeze a random role; returns (role, action, seconds until it is back)."""
    role = rng.choice(group.roles)
    action = "SIGSTOP" if rng.random() < stop_share else "SIGKILL"
    victim = group.processes()[role]
    started = time.monotonic()
    victim.send_signal(signal.SIGSTOP if action == "SIGSTOP" else signal.SIGKILL)
    deadline = started + 300
    while True:  # a new process of that role, then the group healthy and serving again
        current = group.processes().get(role)
        if current is not None and current.pid != victim.pid:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"{role} was not restarted after {action}")
        time.sleep(0.05)
    group.wait_ready(300)  # the scheduler healthy (no role down) and the ingress answering
    return role, action, time.monotonic() - started


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of chaos")
    ap.add_argument("--streams", type=int, default=48, help="ZMQ streams kept in flight")
    ap.add_argument("--interval", type=float, nargs=2, default=(10.0, 40.0),
                    help="seconds between faults: uniform in [lo, hi]")
    ap.add_argument("--min-faults", type=int, default=0,
                    help="go on past --duration until this many faults were injected (a slow "
                         "recovery on a loaded host leaves room for fewer)")
    ap.add_argument("--stop-share", type=float, default=0.3, help="share of SIGSTOP faults")
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel worker ranks")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-cache-memory", default="256MiB")
    ap.add_argument("--workload", type=int, default=64, help="distinct requests")
    ap.add_argument("--max-tokens", type=int, nargs=2, default=(16, 96),
                    help="each request's output length: uniform in [lo, hi]")
    ap.add_argument("--step-timeout", type=float, default=10.0)
    ap.add_argument("--heartbeat-timeout", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-store", action="store_true")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)

    from pagedserve.pipeline.model_resolution import resolve_model
    from pagedserve.pipeline.config import EngineConfig
    from pagedserve.pipeline.tokenizer import load_tokenizer
    config = EngineConfig.from_kwargs(model=args.model)
    resolve_model(config)
    args.model = config.model_info.model_dir
    work = workload(load_tokenizer(config.model_info.tokenizer_dir), args.workload, rng,
                    tuple(args.max_tokens))

    group = SoakGroup(args)
    try:
        print(f"reference: {len(work)} requests without faults", flush=True)
        futures = [group.client.submit(p, greedy(n)) for p, n in work]
        reference = [f.result(900).outputs[0].token_ids for f in futures]
        model = httpx.get(f"{group.base}/v1/models", timeout=30).json()["data"][0]["id"]
        start_resources = group.resources()
        streams = Streams(group, work, reference, args.streams, rng)
        probe = HttpProbe(group.base, model)
        threads = streams.start() + probe.start()
        faults, recoveries = [], []
        began = time.monotonic()
        while time.monotonic() - began < args.duration or len(faults) < args.min_faults:
            pause = rng.uniform(*args.interval)
            if len(faults) >= args.min_faults:
                pause = min(pause, max(0.0, args.duration - (time.monotonic() - began)))
            time.sleep(pause)
            if time.monotonic() - began >= args.duration and len(faults) >= args.min_faults:
                break
            role, action, seconds = inject(group, rng, args.stop_share)
            faults.append(f"{role}:{action}")
            recoveries.append(seconds)
            print(f"  {time.monotonic() - began:6.0f}s {role} {action}: back in {seconds:.1f}s; "
                  f"completed {streams.completed}, lost {streams.lost}, differing "
                  f"{streams.differing}", flush=True)
        streams.stop.set()
        probe.stop.set()
        for t in threads:
            t.join(600)
        time.sleep(2.0)  # let freed blocks and closed sockets settle
        end_resources = group.resources()
        blocks = group.client.stats()["kv_blocks_used"]
    finally:
        code = group.close()
    recoveries.sort()
    result = {
        "duration_s": args.duration, "streams": args.streams, "tp": args.tp,
        "faults": len(faults), "faults_by_kind": {k: faults.count(k) for k in sorted(set(faults))},
        "completed": streams.completed, "lost": streams.lost,
        "duplicated_tokens": streams.duplicated, "differing": streams.differing,
        "http_completed": probe.completed, "http_lost": probe.lost,
        "http_5xx": probe.server_errors,
        "recovery_s_p50": round(statistics.median(recoveries), 2) if recoveries else None,
        "recovery_s_p99": round(recoveries[min(len(recoveries) - 1,
                                               int(0.99 * len(recoveries)))], 2)
        if recoveries else None,
        "recovery_s_max": round(max(recoveries), 2) if recoveries else None,
        "resources_start": start_resources, "resources_end": end_resources,
        "kv_blocks_used_at_end": blocks, "group_exit_code": code,
        "errors": streams.errors[:5],
    }
    if not args.no_store:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import bench_record
        print(f"stored in {bench_record.store('chaos_soak', result, argv)}", flush=True)
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
