"""Requests wait here, in the scheduler's queue but not its batch, until their grammar is ready.

Pure bookkeeping over a GrammarCompiler: `hold` a request whose grammar is not compiled yet,
`release` returns the ones whose grammar is ready and the ones whose compile failed or timed out
(with the message for the client). The scheduler service polls `release` every loop turn.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.pipeline.structured.compiler import GrammarCompiler
from pagedserve.pipeline.structured.spec import StructuredOutputs


@dataclass(slots=True)
class Held:
    request_id: str
    spec: StructuredOutputs
    payload: Any  # what the owner admits once the grammar is ready (the AddRequest, its client)


class GrammarGate:
    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self.held: dict[str, Held] = {}

    def ready(self, spec: StructuredOutputs) -> bool:
        """Whether `spec` is compiled (starting its compile if it is not)."""
        self.compiler.submit(spec)
        return self.compiler.get(spec) is not None

    def hold(self, request_id: str, spec: StructuredOutputs, payload: Any) -> None:
        self.compiler.submit(spec)
        self.held[request_id] = Held(request_id, spec, payload)

    def drop(self, request_id: str) -> bool:
        """An aborted request leaves the queue; True if it was held."""
        return self.held.pop(request_id, None) is not None

    def release(self, now: float | None = None) -> tuple[list[Held], list[tuple[Held, str]]]:
        """(ready to admit, failed with their message), both in arrival order."""
        if not self.held:
            return [], []
        ready, failed = [], []
        for rid, held in list(self.held.items()):
            future = self.compiler.submit(held.spec)
            if future.done():
                del self.held[rid]
                exc = future.exception()
                if exc is None:
                    ready.append(held)
                else:
                    self.compiler.forget(held.spec)
                    failed.append((held, str(exc)))
            elif self.compiler.timed_out(held.spec, now):
                del self.held[rid]
                failed.append((held, f"structured output {held.spec.kind} did not compile within "
                                     f"{self.compiler.timeout_s:g}s"))
        return ready, failed
