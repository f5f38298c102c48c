"""Requests wait here, in the scheduler's queue but not its batch, until their grammar is ready.

Pure bookkeeping over a GrammarCompiler: `hold` a request whose grammar is not compiled yet,
`release` returns the ones whose grammar is ready and the ones whose compile failed or timed out
(with the message for the client). The scheduler service polls `release` every loop turn, so
a held request keeps its spec's key and future: a poll hashes nothing. A compile no held request
waits for any more (timed out, aborted) is forgotten, so a queue of abandoned specs is not
compiled after their clients have gone.
"""
from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from pagedserve.pipeline.structured.compiler import GrammarCompiler
from pagedserve.pipeline.structured.spec import StructuredOutputs


@dataclass(slots=True)
class Held:
    request_id: str
    spec: StructuredOutputs
    payload: Any  # what the owner admits once the grammar is ready (the AddRequest, its client)
    key: str = ""
    future: Future | None = None
    since: float = 0.0


class GrammarGate:
    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self.held: dict[str, Held] = {}
        self._waiting: dict[str, int] = {}  # spec key -> held requests that wait for it

    def ready(self, spec: StructuredOutputs) -> bool:
        """Whether `spec` is compiled (starting its compile if it is not)."""
        self.compiler.submit(spec)
        return self.compiler.get(spec) is not None

    def hold(self, request_id: str, spec: StructuredOutputs, payload: Any,
             now: float | None = None) -> None:
        key = spec.key()
        future = self.compiler.submit_key(spec, key)
        self.held[request_id] = Held(request_id, spec, payload, key, future,
                                     time.monotonic() if now is None else now)
        self._waiting[key] = self._waiting.get(key, 0) + 1

    def drop(self, request_id: str) -> bool:
        """An aborted request leaves the queue; True if it was held."""
        held = self.held.pop(request_id, None)
        if held is None:
            return False
        self._abandon(held)
        return True

    def release(self, now: float | None = None) -> tuple[list[Held], list[tuple[Held, str]]]:
        """(ready to admit, failed with their message), both in arrival order."""
        if not self.held:
            return [], []
        now = time.monotonic() if now is None else now
        ready, failed = [], []
        for rid, held in list(self.held.items()):
            if held.future.done() and not held.future.cancelled():
                del self.held[rid]
                self._unwait(held.key)
                exc = held.future.exception()
                if exc is None:
                    ready.append(held)
                else:
                    self.compiler.forget(held.spec, held.key)
                    failed.append((held, str(exc)))
            elif held.future.cancelled():  # forgotten while this request waited: submit again
                held.future = self.compiler.submit_key(held.spec, held.key)
            elif now - held.since > self.compiler.timeout_s:
                del self.held[rid]
                self._abandon(held)
                failed.append((held, f"structured output {held.spec.kind} did not compile within "
                                     f"{self.compiler.timeout_s:g}s"))
        return ready, failed

    def _abandon(self, held: Held) -> None:
        if self._unwait(held.key):  # no one else waits: a compile still queued is not run
            self.compiler.forget(held.spec, held.key)

    def _unwait(self, key: str) -> bool:
        """One request less waits for `key`'s grammar; True if it was the last."""
        self._waiting[key] -= 1
        if self._waiting[key]:
            return False
        del self._waiting[key]
        return True
