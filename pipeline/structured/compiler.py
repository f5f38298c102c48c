"""Grammar compilation off the step loop: a thread pool, and a cache keyed by the spec's hash.

The vocabulary's xgrammar `TokenizerInfo` is built once (read from the cache folder after the
first start: structured/vocab_cache.py): `warm()` builds it in a daemon thread (the serving
scheduler calls it once idle; it never holds up the process's exit), else the first compile does.
`submit` returns a future per spec; equal specs share it, so 64 requests with one schema
compile once. A compile that runs past `timeout_s` is failed by `poll`, never left pending.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from pagedserve.pipeline.structured.vocab_cache import tokenizer_info
from pagedserve.pipeline.structured.spec import StructuredOutputs, parse_grammar, xgrammar_message
from pagedserve.pipeline.structured.utf8_guard import Utf8Guard

log = logging.getLogger(__name__)


class GrammarCompileError(ValueError):
    pass


class GrammarCompiler:
    """Compiled grammars by spec key, compiled in background threads."""

    def __init__(self, tokenizer_dir: str, vocab_size: int, eos_token_ids: list[int], *,
                 max_threads: int = 2, cache_size: int = 512, timeout_s: float = 30.0) -> None:
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self._pool = ThreadPoolExecutor(max_threads, thread_name_prefix="grammar")
        self._compiler_lock = threading.Lock()
        self._compiler = None
        self._futures: OrderedDict[str, tuple[Future, float]] = OrderedDict()
        self.compile_seconds: list[float] = []  # one per compile, for benchmarks
        self.utf8_guard: Utf8Guard | None = None  # built with the vocabulary, off the step loop

    def warm(self) -> threading.Thread:
        """Build the vocabulary's TokenizerInfo now, in a daemon thread, so the first structured
        request's time to first token does not pay it (seconds on a first start)."""
        thread = threading.Thread(target=self._xgr_compiler, name="grammar-warm", daemon=True)
        thread.start()
        return thread

    @property
    def ready(self) -> bool:
        """Whether the vocabulary's tables are built (by warm() or a first compile)."""
        return self._compiler is not None

    def submit(self, spec: StructuredOutputs, now: float | None = None) -> Future:
        """The (possibly finished) future of `spec`'s compiled grammar."""
        key = spec.key()
        entry = self._futures.get(key)
        if entry is not None:
            self._futures.move_to_end(key)
            return entry[0]
        future = self._pool.submit(self._compile, spec)
        self._futures[key] = (future, time.monotonic() if now is None else now)
        while len(self._futures) > self.cache_size:
            self._futures.popitem(last=False)
        return future

    def get(self, spec: StructuredOutputs):
        """The compiled grammar of a spec submitted before and done; None otherwise."""
        entry = self._futures.get(spec.key())
        if entry is None or not entry[0].done() or entry[0].exception() is not None:
            return None
        return entry[0].result()

    def timed_out(self, spec: StructuredOutputs, now: float | None = None) -> bool:
        entry = self._futures.get(spec.key())
        now = time.monotonic() if now is None else now
        return entry is not None and not entry[0].done() and now - entry[1] > self.timeout_s

    def forget(self, spec: StructuredOutputs) -> None:
        """Drop a spec's entry (a timed-out compile: a later request starts afresh)."""
        self._futures.pop(spec.key(), None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- in the pool's threads ----------------------------------------------------------------
    def _xgr_compiler(self):
        with self._compiler_lock:  # concurrent first compiles build the vocabulary once
            if self._compiler is None:
                self._compiler = self._build_compiler()
        return self._compiler

    def _build_compiler(self):
        import xgrammar as xgr
        from pagedserve import envs
        started = time.perf_counter()
        info = tokenizer_info(self.tokenizer_dir, self.vocab_size, self.eos_token_ids,
                              envs.current().cache_root)
        self.utf8_guard = Utf8Guard(info.decoded_vocab, (self.vocab_size + 31) // 32)
        log.info("grammar compiler ready for %d tokens in %.2fs", self.vocab_size,
                 time.perf_counter() - started)
        return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def _compile(self, spec: StructuredOutputs):
        compiler = self._xgr_compiler()
        started = time.perf_counter()
        try:
            compiled = compiler.compile_grammar(parse_grammar(spec))
        except RuntimeError as exc:
            raise GrammarCompileError(f"structured output {spec.kind} does not compile: "
                                      f"{xgrammar_message(exc)}") from None
        self.compile_seconds.append(time.perf_counter() - started)
        return compiled
