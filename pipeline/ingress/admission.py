"""Overload decisions made before a request costs any tokenization.

The scheduler is the authority (a full queue answers RequestError 503), but asking it means
tokenizing first. This ingress keeps a cheap local view instead: its own in-flight engine
requests, the last stats snapshot, and the time of the last 503 the scheduler gave it.
Pure code; the clock is passed in.
"""
from __future__ import annotations

from dataclasses import dataclass

SNAPSHOT_FRESH_S = 2.0   # a stats snapshot older than this says nothing about the queue
REJECT_BACKOFF_S = 0.5   # after a scheduler 503, refuse locally this long unless stats say room


@dataclass(slots=True)
class AdmissionController:
    max_queued_requests: int
    max_num_seqs: int
    in_flight: int = 0
    _snapshot_time: float = float("-inf")
    _snapshot_waiting: int = 0
    _last_reject_time: float = float("-inf")

    @property
    def capacity(self) -> int:
        """The most engine requests the scheduler can hold: running slots plus its queue."""
        return self.max_queued_requests + self.max_num_seqs

    def refusal(self, num_requests: int, now: float) -> str | None:
        """Why `num_requests` new engine requests must be refused now, or None to admit."""
        if self.in_flight + num_requests > self.capacity:
            return (f"this server already has {self.in_flight} requests in flight and the "
                    f"engine holds at most {self.capacity} (--max-num-seqs "
                    f"{self.max_num_seqs} + --max-queued-requests {self.max_queued_requests})")
        fresh = now - self._snapshot_time <= SNAPSHOT_FRESH_S
        if fresh and self._snapshot_waiting >= self.max_queued_requests:
            return (f"the engine's queue is full ({self._snapshot_waiting} waiting, "
                    f"--max-queued-requests {self.max_queued_requests})")
        recently_rejected = now - self._last_reject_time <= REJECT_BACKOFF_S
        if recently_rejected and not (fresh and self._snapshot_time > self._last_reject_time):
            return "the engine refused a request moments ago because its queue was full"
        return None

    def enter(self, num_requests: int) -> None:
        self.in_flight += num_requests

    def leave(self, num_requests: int) -> None:
        self.in_flight -= num_requests

    def observe_stats(self, stats: dict, now: float) -> None:
        self._snapshot_time = now
        self._snapshot_waiting = int(stats.get("num_requests_waiting", 0))

    def observe_rejection(self, now: float) -> None:
        self._last_reject_time = now

    def snapshot_age(self, now: float) -> float:
        return now - self._snapshot_time
