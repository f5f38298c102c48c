"""Grammar compilation off the step loop: bounded compile processes, and a cache keyed by the
spec's hash.

The vocabulary's xgrammar `TokenizerInfo` is built once (read from the cache folder after the
first start: structured/vocab_cache.py): `warm()` builds it in a daemon thread and starts a
compile process (the serving scheduler calls it once idle; it never holds up the process's
exit), else the first compile does. `submit` returns a future per spec; equal specs share it,
so 64 requests with one schema compile once. Compiles run in compile_pool.py's processes,
inside CPU, memory and wall-time limits (`CompileLimits`): one past a limit is stopped (its
process killed) and fails with a message naming the limit, and never holds up the others.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future

from pagedserve.pipeline.structured.compile_child import Done, Hello
from pagedserve.pipeline.structured.compile_pool import (CompileLimits, CompilePool,
                                                       GrammarCompileError)
from pagedserve.pipeline.structured.spec import StructuredOutputs
from pagedserve.pipeline.structured.utf8_guard import Utf8Guard
from pagedserve.pipeline.structured.vocab_cache import tokenizer_info

log = logging.getLogger(__name__)

__all__ = ["CompileLimits", "GrammarCompileError", "GrammarCompiler"]


class GrammarCompiler:
    """Compiled grammars by spec key, compiled in bounded child processes."""

    def __init__(self, tokenizer_dir: str, vocab_size: int, eos_token_ids: list[int], *,
                 max_threads: int = 2, cache_size: int = 512, timeout_s: float = 30.0,
                 limits: CompileLimits | None = None) -> None:
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.limits = limits or CompileLimits(timeout_s=timeout_s, processes=max_threads)
        self.timeout_s = self.limits.timeout_s  # read per compile: a test may change it
        self.cache_size = cache_size
        self._pool = CompilePool(self._hello, self._deserialize, self.limits,
                                 timeout_s=lambda: self.timeout_s)
        self._info_lock = threading.Lock()
        self._info = None
        self._warmed: Future | None = None  # warm()'s compile process start
        self._futures: OrderedDict[str, tuple[Future, float]] = OrderedDict()
        self.compile_seconds: list[float] = []  # one per compile, for benchmarks
        self.utf8_guard: Utf8Guard | None = None  # built with the vocabulary, off the step loop

    def warm(self) -> threading.Thread:
        """Build the vocabulary's TokenizerInfo now, in a daemon thread, and start a compile
        process, so the first structured request's time to first token pays neither (seconds
        on a first start)."""
        def build():
            self._tokenizer_info()
            self._warmed = self._pool.warm()
        thread = threading.Thread(target=build, name="grammar-warm", daemon=True)
        thread.start()
        return thread

    @property
    def warmed(self) -> bool:
        """Whether warm() has done its one-time work: the tables built and a compile process
        started (or its start failed: the first compile then tries again)."""
        return self._warmed is not None and self._warmed.done()

    @property
    def ready(self) -> bool:
        """Whether the vocabulary's tables are built (by warm() or a first compile)."""
        return self._info is not None

    @property
    def process_ids(self) -> list[int]:
        """The compile processes running now (tests watch them end)."""
        return self._pool.pids

    def submit(self, spec: StructuredOutputs, now: float | None = None) -> Future:
        """The (possibly finished) future of `spec`'s compiled grammar."""
        return self.submit_key(spec, spec.key(), now)

    def submit_key(self, spec: StructuredOutputs, key: str, now: float | None = None) -> Future:
        """`submit` with the spec's key already computed (it hashes the whole spec)."""
        entry = self._futures.get(key)
        if entry is not None:
            self._futures.move_to_end(key)
            return entry[0]
        future = self._pool.submit(spec)
        self._futures[key] = (future, time.monotonic() if now is None else now)
        while len(self._futures) > self.cache_size:
            self._futures.popitem(last=False)
        return future

    def get(self, spec: StructuredOutputs):
        """The compiled grammar of a spec submitted before and done; None otherwise."""
        entry = self._futures.get(spec.key())
        if entry is None or not entry[0].done() or entry[0].cancelled() \
                or entry[0].exception() is not None:
            return None
        return entry[0].result()

    def timed_out(self, spec: StructuredOutputs, now: float | None = None) -> bool:
        entry = self._futures.get(spec.key())
        now = time.monotonic() if now is None else now
        return entry is not None and not entry[0].done() and now - entry[1] > self.timeout_s

    def forget(self, spec: StructuredOutputs, key: str | None = None) -> None:
        """Drop a spec's entry (a failed or abandoned compile: a later request starts afresh);
        a compile still queued is not run."""
        entry = self._futures.pop(key or spec.key(), None)
        if entry is not None:
            entry[0].cancel()

    def close(self) -> None:
        self._pool.close()

    # -- in the compile slots' threads ---------------------------------------------------------
    def _tokenizer_info(self):
        with self._info_lock:  # concurrent first compiles build the vocabulary once
            if self._info is None:
                self._info = self._build_info()
        return self._info

    def _build_info(self):
        from pagedserve import envs
        started = time.perf_counter()
        info = tokenizer_info(self.tokenizer_dir, self.vocab_size, self.eos_token_ids,
                              envs.current().cache_root)
        self.utf8_guard = Utf8Guard(info.decoded_vocab, (self.vocab_size + 31) // 32)
        log.info("grammar tables ready for %d tokens in %.2fs", self.vocab_size,
                 time.perf_counter() - started)
        return info

    def _hello(self) -> Hello:
        from pagedserve import envs
        self._tokenizer_info()  # first: the compile process then reads the tables from the cache
        return Hello(self.tokenizer_dir, self.vocab_size, self.eos_token_ids,
                     str(envs.current().cache_root), self.limits.memory_mb,
                     self.limits.max_grammar_mb)

    def _deserialize(self, done: Done):
        import xgrammar as xgr
        compiled = xgr.CompiledGrammar.deserialize_json(done.grammar, self._tokenizer_info())
        self.compile_seconds.append(done.seconds)
        return compiled
