"""Grammar compiles in child processes that a limit really stops.

A thread cannot be stopped, so a compile past its timeout used to go on: two slow specs held
both compile threads, and every later structured request waited behind them. Here each slot
is a thread that owns one compile process (compile_child.py); the process compiles inside CPU
and memory limits (RLIMIT_CPU, RLIMIT_AS, set in the child) and the slot kills it when a compile
runs past `timeout_s` of wall time. The failed request hears why ("grammar compilation
exceeded 30 s"); the slot starts a fresh process for its next job; the other slots go on.
Slots are added when a job finds none idle, up to `processes`: one process serves requests
that come one at a time, and slow specs hold only the slots they run in.
The compiled grammar comes back serialized and is rebuilt against the parent's vocabulary.
"""
from __future__ import annotations

import logging
import math
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import msgspec

from pagedserve import envs
from pagedserve.pipeline.structured.compile_child import Done, Hello, Job
from pagedserve.pipeline.structured.spec import StructuredOutputs

log = logging.getLogger(__name__)


class GrammarCompileError(ValueError):
    """A spec that does not compile, or whose compile exceeded a limit: the client's 400."""


@dataclass(frozen=True, slots=True)
class CompileLimits:
    """What one grammar compile may use."""
    timeout_s: float = 30.0     # wall time; the process is killed past it
    cpu_s: int | None = None    # CPU time (RLIMIT_CPU); None: the timeout's, rounded up
    memory_mb: int = 2048       # address space a compile may add to its process
    max_grammar_mb: int = 256   # the compiled grammar, serialized, as it comes back
    processes: int = 4          # compiles at once (each process holds ~300 MB: xgrammar, torch)
    start_timeout_s: float = 300.0  # a process's start (imports, the vocabulary's tables)
    idle_exit_s: float = 120.0  # a process beyond the first ends after this long without work

    def __post_init__(self) -> None:
        if self.processes < 1 or self.memory_mb < 1 or self.max_grammar_mb < 1 \
                or self.timeout_s <= 0 or self.idle_exit_s <= 0:
            raise ValueError(f"grammar compile limits must be positive: {self}")


class _Process:
    """One compile process, fed one job at a time."""

    def __init__(self, hello: Hello, start_timeout_s: float) -> None:
        to_child, self._stdin = os.pipe()
        self._stdout, from_child = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pagedserve.pipeline.structured.compile_child"],
                stdin=to_child, stdout=from_child, close_fds=True,
                env=envs.child_environ(**{envs.ROLE_VARIABLE: "grammar-compiler"}))
        finally:
            os.close(to_child)
            os.close(from_child)
        self._send = Connection(self._stdin, readable=False)
        self._recv = Connection(self._stdout, writable=False)
        self.max_reply = hello.max_grammar_mb * 2**20 + 2**20
        self._send.send_bytes(msgspec.msgpack.encode(hello))
        self._reply(start_timeout_s, "starting")
        log.info("grammar compile process started pid=%d", self.proc.pid)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def compile(self, spec: StructuredOutputs, timeout_s: float, cpu_s: int) -> Done:
        self._send.send_bytes(msgspec.msgpack.encode(Job(spec, cpu_s)))
        return self._reply(timeout_s, "grammar compilation", cpu_s)

    def _reply(self, timeout_s: float, doing: str, cpu_s: int = 0) -> Done:
        if not self._recv.poll(max(timeout_s, 0.001)):
            self.kill()
            raise GrammarCompileError(f"{doing} exceeded {timeout_s:g} s and was stopped")
        try:
            return msgspec.msgpack.decode(self._recv.recv_bytes(self.max_reply), type=Done)
        except (EOFError, OSError, msgspec.DecodeError):
            code = self.kill()
        if code == -signal.SIGXCPU:
            raise GrammarCompileError(f"{doing} exceeded its CPU time limit of {cpu_s} s")
        raise GrammarCompileError(f"{doing} failed: its process ended ({_exit_cause(code)})")

    def kill(self) -> int:
        """End the process (if it still runs) and close the pipes; its exit code."""
        if self.proc.poll() is None:
            self.proc.kill()
        code = self.proc.wait()
        self._send.close()
        self._recv.close()
        return code


def _exit_cause(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}" if -code in signal.valid_signals() \
            else f"signal {-code}"
    return f"exit code {code}"


_WARM = object()  # a job that only starts a slot's process
_IDLE = object()  # no job came within idle_exit_s


class CompilePool:
    """Compiles specs in up to `limits.processes` processes; `submit` returns a future of the
    deserialized grammar. A cancelled future's job is skipped when its turn comes. The first
    slot keeps its process; others end theirs once idle for `limits.idle_exit_s`."""

    def __init__(self, hello: Callable[[], Hello], deserialize: Callable[[Done], Any],
                 limits: CompileLimits, timeout_s: Callable[[], float] | None = None) -> None:
        self.limits = limits
        self._hello = hello              # built on first use: it needs the vocabulary's tables
        self._deserialize = deserialize  # in the slot's thread, off the step loop
        self._timeout_s = timeout_s or (lambda: limits.timeout_s)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._slots = 0                  # slot threads running
        self._idle = 0                   # of them, waiting for a job (a job finding none adds one)
        self._started = 0                # slots ever started (their names)
        self._closed = False
        self._processes: dict[int, _Process] = {}  # slot -> its compile process

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in list(self._processes.values())]

    def submit(self, spec: StructuredOutputs) -> Future:
        future: Future = Future()
        self._put((spec, future))
        return future

    def warm(self) -> Future:
        """Start one process now, so the first structured request does not wait for it; the
        future is done once the process has started (or failed to)."""
        future: Future = Future()
        self._put((_WARM, future))
        return future

    def close(self) -> None:
        """Cancel what waits; end the slots, killing their processes."""
        with self._lock:
            self._closed = True
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job[1].cancel()
            for _ in range(self._slots):
                self._jobs.put(None)
            for process in list(self._processes.values()):
                process.proc.kill()  # its slot sees the pipe close, and reaps it

    def _put(self, job) -> None:
        with self._lock:
            if self._closed:
                raise GrammarCompileError("the grammar compiler is closed")
            self._jobs.put(job)
            if self._jobs.qsize() > self._idle and self._slots < self.limits.processes:
                slot, self._started, self._slots = self._started, self._started + 1, self._slots + 1
                threading.Thread(target=self._serve, args=(slot,), daemon=True,
                                 name=f"grammar-compile-{slot}").start()

    def _next_job(self, slot: int):
        """The slot's next job; None when it is to end (closed, or idle, but for slot 0)."""
        while True:
            with self._lock:
                self._idle += 1
            try:
                job = self._jobs.get(timeout=None if slot == 0 else self.limits.idle_exit_s)
            except queue.Empty:
                job = _IDLE
            with self._lock:
                self._idle -= 1
                if job is _IDLE and self._jobs.qsize():
                    continue  # a job came as the wait ended
                if job is _IDLE or job is None:
                    self._slots -= 1
                    return None
                return job

    def _serve(self, slot: int) -> None:
        """A slot's loop. The process it starts is tied to this thread (PR_SET_PDEATHSIG)."""
        try:
            while (job := self._next_job(slot)) is not None:
                self._job(slot, *job)
        finally:
            process = self._processes.pop(slot, None)
            if process is not None:
                process.kill()

    def _job(self, slot: int, spec, future: Future) -> None:
        if not future.set_running_or_notify_cancel():
            return  # forgotten while queued: no request waits for it any more
        result = error = None
        try:
            if slot not in self._processes:
                self._processes[slot] = _Process(self._hello(), self.limits.start_timeout_s)
            if spec is not _WARM:
                result = self._run(self._processes[slot], spec)
        except GrammarCompileError as exc:
            error = exc
        except Exception as exc:  # never leave a request waiting on a dead slot
            log.exception("grammar compile slot %d failed", slot)
            error = GrammarCompileError(f"grammar compiler failed: {exc}")
        process = self._processes.get(slot)
        if process is not None and process.proc.poll() is not None:
            self._processes.pop(slot).kill()  # ended or killed: the next job starts a fresh one
        if error is not None:  # after the clean-up above, which a waiter may then observe
            future.set_exception(error)
        else:
            future.set_result(result)

    def _run(self, process: _Process, spec: StructuredOutputs) -> Any:
        timeout_s = self._timeout_s()
        cpu_s = self.limits.cpu_s or max(1, math.ceil(timeout_s))
        done = process.compile(spec, timeout_s, cpu_s)
        if done.fatal:
            process.kill()
        if done.error is not None:
            raise GrammarCompileError(done.error)
        return self._deserialize(done)
