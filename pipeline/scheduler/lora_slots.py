"""How many LoRA adapters one step may use: --max-loras, the slots the workers hold.

A waiting or swapped sequence joins the running ones only while the step's distinct adapters
stay within the limit (the base model takes none); otherwise it waits at the head of its queue
like a sequence short of blocks, until running sequences of some adapter finish.
"""
from __future__ import annotations

from collections.abc import Iterable

from pagedserve.pipeline.scheduler.sequence import RequestState, Sequence, SequenceStatus

RUNNING, WAITING, SWAPPED = SequenceStatus.RUNNING, SequenceStatus.WAITING, SequenceStatus.SWAPPED


class StepAdapters:
    """The distinct adapters of a step's running sequences, worked out on first need (a step
    with no adapter waiting never looks)."""

    __slots__ = ("max_loras", "_running", "_ids")

    def __init__(self, max_loras: int, *running: Iterable[Sequence]) -> None:
        self.max_loras = max_loras
        self._running = running
        self._ids: set[int] | None = None

    def admits(self, request: RequestState) -> bool:
        """Whether a sequence of `request` may join without passing the limit."""
        lora = request.lora
        if lora is None:
            return True
        if self._ids is None:
            self._ids = {seq.request.lora.lora_int_id for group in self._running
                         for seq in group if seq.request.lora is not None}
        return lora.lora_int_id in self._ids or len(self._ids) < self.max_loras

    def add(self, request: RequestState) -> None:
        """A sequence of `request` joined the step."""
        if request.lora is not None and self._ids is not None:
            self._ids.add(request.lora.lora_int_id)


def lora_stats(queues, max_loras: int) -> dict:
    """vLLM's lora_requests_info: the adapters of running and of waiting (or swapped)
    sequences, by name, and the limit (for /metrics: one stats call a second at most)."""
    running = {seq.request.lora.lora_name for group in (queues.running, queues.prefilling)
               for seq in group if seq.status is RUNNING and seq.request.lora is not None}
    waiting = {seq.request.lora.lora_name for heap, status in ((queues.waiting, WAITING),
                                                                (queues.swapped, SWAPPED))
               for _, seq in heap if seq.status is status and seq.request.lora is not None}
    return {"lora_running": sorted(running), "lora_waiting": sorted(waiting),
            "max_lora": max_loras}
