"""Real process groups with faults: launched through `python -m pagedserve.pipeline.launch`, driven with
the ZMQ client library, asserted on what clients see."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from pagedserve.lifecycle import stop_process_group
from pagedserve.pipeline import SamplingParams
from pagedserve.pipeline.client import EngineClient
from pagedserve.workers.loader import TEST_MODEL, resolve_model
from pagedserve.pipeline.tokenizer import load_tokenizer

TOPICS = ["the sea", "mountains", "a robot", "bread", "the moon", "rivers", "chess", "winter",
          "a library", "trains", "coffee", "bees", "volcanoes", "music", "a garden", "clocks"]
PROMPTS = [f"Write one sentence about {t}." if i % 2 == 0 else f"Q: What do you know about {t}?\nA:"
           for i, t in enumerate(TOPICS * 2)]
LAUNCH_SH = Path(__file__).resolve().parents[2] / "scripts" / "launch.sh"
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def sampled(i: int, max_tokens: int = 20) -> SamplingParams:
    """Seeded sampling: reproducible, recompute and restarts included."""
    return SamplingParams(temperature=0.8, top_p=0.95, seed=1000 + i, max_tokens=max_tokens,
                          ignore_eos=True)


@pytest.fixture(scope="session")
def model_dir():
    return resolve_model(TEST_MODEL)


@pytest.fixture(scope="session")
def prompt_ids(model_dir):
    tok = load_tokenizer(model_dir)
    return [tok.encode(p) for p in PROMPTS]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Group:
    """One launched group, a ZMQ client on it, and handles on its role processes."""

    def __init__(self, model_dir, *, tp: int = 1, fault: str = "", http: bool = False,
                 extra: tuple[str, ...] = (), wait_http: bool = True, launch_sh: bool = False):
        """`launch_sh`: started as a user starts it, `scripts/launch.sh` from the repository
        root (`model_dir` None: the default model)."""
        # A folder the launcher creates (and so removes) inside one of ours
        self.parent_dir = tempfile.mkdtemp(prefix="pagedserve-test-")
        self.ipc_dir = os.path.join(self.parent_dir, "ipc")
        self.port = free_port() if http else None
        cmd = (["bash", str(LAUNCH_SH)] if launch_sh
               else [sys.executable, "-m", "pagedserve.pipeline.launch"])
        cmd += [] if model_dir is None else ["--model", str(model_dir)]
        cmd += ["--dtype", "float32", "--kv-cache-memory", "96MiB", "--swap-space", "0.05",
               "--tensor-parallel-size", str(tp), "--ipc-dir", self.ipc_dir,
               "--step-timeout", "20", "--heartbeat-timeout", "8", "--die-with-parent", *extra]
        cmd += ["--port", str(self.port)] if http else ["--no-http"]
        env = dict(os.environ, PAGEDSERVE_FAULT=fault)
        self.proc = subprocess.Popen(cmd, env=env, start_new_session=True,
                                     cwd=LAUNCH_SH.parents[1] if launch_sh else None)
        self.frontend = f"ipc://{self.ipc_dir}/frontend.sock"
        self.output = f"ipc://{self.ipc_dir}/output.sock"
        self.client = EngineClient(self.frontend, self.output, connect_timeout=600)
        self.wait_healthy(600)
        if http and wait_http:   # the engine can be up before the ingress listens
            self.wait_http(120)

    def wait_http(self, timeout: float) -> None:
        import httpx
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert self.proc.poll() is None, f"group exited with {self.proc.returncode}"
            assert time.monotonic() < deadline, "the ingress did not answer /health in time"
            time.sleep(0.2)

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.client.health(timeout=2):
            assert self.proc.poll() is None, f"group exited with {self.proc.returncode}"
            assert time.monotonic() < deadline, "group not healthy in time"
            time.sleep(0.2)

    def pid_of(self, name: str) -> int:
        """pid of a role by the launcher's name: scheduler, worker0, detokenizer, ingress."""
        for child in psutil.Process(self.proc.pid).children():
            try:
                if child.environ().get("PAGEDSERVE_ROLE") == name:
                    return child.pid
            except psutil.Error:
                continue
        raise LookupError(f"no live {name} process")

    def kill(self, name: str) -> int:
        pid = self.pid_of(name)
        os.kill(pid, signal.SIGKILL)
        return pid

    def pids(self, names) -> dict[str, int | None]:
        found = {}
        for name in names:
            try:
                found[name] = self.pid_of(name)
            except LookupError:
                found[name] = None  # between a death and the restart
        return found

    def restarts(self) -> dict[str, int]:
        """Restarts by role as the scheduler counts them (the worker group as "worker")."""
        return self.client.stats()["restarts"]

    def wait_restarted(self, name: str, old_pid: int, timeout: float = 120) -> int:
        """Until role `name` runs as a new process (and is healthy again); its new pid."""
        deadline = time.monotonic() + timeout
        while True:
            pid = self.pids([name])[name]
            if pid is not None and pid != old_pid:
                self.wait_healthy(max(1.0, deadline - time.monotonic()))
                return pid
            assert time.monotonic() < deadline, f"{name} pid={old_pid} was not restarted"
            time.sleep(0.1)

    def submit_all(self, prompt_ids, params=GREEDY):
        """`params`: one SamplingParams for all, or a function of the prompt's index."""
        return [self.client.submit(ids, params(i) if callable(params) else params)
                for i, ids in enumerate(prompt_ids)]

    def wait_tokens(self, at_least: int, timeout: float = 120) -> None:
        """Until the scheduler has generated `at_least` tokens in total."""
        deadline = time.monotonic() + timeout
        while self.client.stats()["generation_tokens"] < at_least:
            assert time.monotonic() < deadline, "generation did not progress"
            time.sleep(0.05)

    def blocks_in_use(self) -> int:
        deadline = time.monotonic() + 10
        while True:
            used = self.client.stats()["kv_blocks_used"]
            if used == 0 or time.monotonic() > deadline:
                return used
            time.sleep(0.1)

    def close(self) -> int:
        self.client.close()
        return stop_process_group(self.proc, 120)

    def leftovers(self) -> list[str]:
        from pagedserve.pipeline.config import IpcArgs
        tag = IpcArgs(ipc_dir=self.ipc_dir).tag
        found = [f"/dev/shm/{n}" for n in os.listdir("/dev/shm") if n.startswith(tag)]
        if os.path.exists(self.ipc_dir):
            found.append(self.ipc_dir)
        try:
            os.rmdir(self.parent_dir)  # ours, and empty unless the launcher left something
        except FileNotFoundError:
            pass
        except OSError:
            found.append(self.parent_dir)
        for p in psutil.process_iter(["cmdline"]):
            if self.ipc_dir in " ".join(p.info["cmdline"] or []):
                found.append(f"pid {p.pid}")
        return found


def token_ids(futures, timeout: float = 300) -> list[list[int]]:
    return [f.result(timeout).outputs[0].token_ids for f in futures]
