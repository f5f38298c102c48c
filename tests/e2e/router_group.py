"""A router process with its local engine groups, for the router's end-to-end tests."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.lifecycle import stop_process_group
from faults.conftest import free_port

ENGINE_FLAGS = ("--dtype", "float32", "--kv-cache-memory", "96MiB", "--swap-space", "0.05")


class Router:
    """`python -m pagedserve.pipeline.launch <router flags>` with a private TMPDIR, so that
    everything its groups create can be checked for leftovers."""

    def __init__(self, *flags: str, ready_timeout: float = 600):
        self.tmp = tempfile.mkdtemp(prefix="pagedserve-routertest-")
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "pagedserve.pipeline.launch", *flags, "--host", "127.0.0.1",
               "--port", str(self.port), "--die-with-parent", *ENGINE_FLAGS]
        self.proc = subprocess.Popen(cmd, env=dict(os.environ, TMPDIR=self.tmp),
                                     start_new_session=True)
        self.ipc_dirs: set[str] = set()
        self.wait_health(ready_timeout)

    def wait_health(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"router exited with {self.proc.returncode}"
            try:
                if httpx.get(f"{self.base}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the router did not answer /health in time"
            time.sleep(0.25)

    def launchers(self) -> list[psutil.Process]:
        """The engine groups' launchers now running (each a child of the router)."""
        found = []
        for child in psutil.Process(self.proc.pid).children():
            try:
                cmd = child.cmdline()
            except psutil.Error:
                continue
            if "pagedserve.pipeline.launch" in cmd:
                self.ipc_dirs.add(cmd[cmd.index("--ipc-dir") + 1])
                found.append(child)
        return found

    def replicas(self) -> dict[str, tuple[str, dict[str, str]]]:
        """{replica name: (URL, the headers the replica asks for)} of the running groups, from
        their launchers' command lines and the secret files in their private folders (ours:
        this test runs as the router's user). The router's /metrics shows no URL."""
        from pagedserve.pipeline.ingress.replica_secret import REPLICA_SECRET_HEADER
        found = {}
        for launcher in self.launchers():
            cmd = launcher.cmdline()
            folder = os.path.dirname(cmd[cmd.index("--ipc-dir") + 1])
            index = os.path.basename(folder).split("-")[2]  # pagedserve-router-<index>-...
            with open(cmd[cmd.index("--replica-secret-file") + 1]) as f:
                headers = {REPLICA_SECRET_HEADER: f.read()}
            name = f"{cmd[cmd.index('--served-model-name') + 1]}/{index}"
            found[name] = (f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}", headers)
        return found

    def launcher_on(self, url: str) -> psutil.Process:
        port = url.rsplit(":", 1)[1]
        for launcher in self.launchers():
            cmd = launcher.cmdline()
            if cmd[cmd.index("--port") + 1] == port:
                return launcher
        raise LookupError(f"no engine group on {url}")

    def metrics(self) -> dict[tuple, float]:
        """{(name, sorted label items): value} of the router's /metrics."""
        return scrape(f"{self.base}/metrics")

    def replica_urls(self) -> dict[str, str]:
        return {name: url for name, (url, _headers) in self.replicas().items()}

    def close(self) -> int:
        self.launchers()  # remember their folders for leftovers()
        return stop_process_group(self.proc, 180)

    def leftovers(self) -> list[str]:
        from pagedserve.pipeline.config import IpcArgs
        found = [os.path.join(self.tmp, n) for n in os.listdir(self.tmp)]
        tags = {IpcArgs(ipc_dir=d).tag for d in self.ipc_dirs}
        found += [f"/dev/shm/{n}" for n in os.listdir("/dev/shm")
                  if any(n.startswith(t) for t in tags)]
        for p in psutil.process_iter(["cmdline"]):
            if self.tmp in " ".join(p.info["cmdline"] or []):
                found.append(f"pid {p.pid}")
        shutil.rmtree(self.tmp, ignore_errors=True)
        return found


def alive(procs: list[psutil.Process]) -> list[int]:
    """The pids of `procs` still running; a zombie is not (an orphan's exit waits for init to
    reap it: the resource trackers of a stopped group's scheduler and worker, say)."""
    found = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return found


def scrape(url: str, headers: dict[str, str] | None = None) -> dict[tuple, float]:
    out = {}
    text = httpx.get(url, headers=headers, timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def metric(samples: dict[tuple, float], name: str, **labels) -> float:
    """The sum of `name` over the samples whose labels include `labels`."""
    return sum(v for (n, items), v in samples.items()
               if n == name and labels.items() <= dict(items).items())
