"""Scheduling policies: the order of the waiting queue, and who may push out whom.

The same key orders admissions (smallest first) and picks preemption victims (largest first), so
the sequence admitted last is the first to go.
"""
from __future__ import annotations

from pagedserve.pipeline.scheduler.sequence import Sequence


class FCFSPolicy:
    """Oldest request first; priorities are ignored and nobody is pushed out for a newcomer."""

    name = "fcfs"
    preempts_for_waiting = False  # lets the scheduler skip the check entirely

    @staticmethod
    def key(seq: Sequence) -> tuple:
        return (seq.request.arrival_time, seq.seq_id)

    @staticmethod
    def may_preempt(waiting: Sequence, running: Sequence) -> bool:
        return False


class PriorityPolicy:
    """Lower `priority` value first, then oldest; a waiting request may preempt a running one of
    strictly lower priority (higher value) when blocks are short."""

    name = "priority"
    preempts_for_waiting = True

    @staticmethod
    def key(seq: Sequence) -> tuple:
        return (seq.request.priority, seq.request.arrival_time, seq.seq_id)

    @staticmethod
    def may_preempt(waiting: Sequence, running: Sequence) -> bool:
        return waiting.request.priority < running.request.priority


POLICIES = {FCFSPolicy.name: FCFSPolicy, PriorityPolicy.name: PriorityPolicy}


def make_policy(name: str):
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r}; known: {', '.join(POLICIES)}") from None
