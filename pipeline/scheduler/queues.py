"""Where each live sequence waits or runs, the counts the caps are checked against, and the
policy that orders the queues (its key: admit smallest first, preempt largest first). Every move
between the queues is one `SequenceQueues` method, which also records the sequence's status.
"""
from __future__ import annotations

import heapq
from typing import Callable

from pagedserve.pipeline.scheduler.sequence import (RUNNING, SWAPPED, WAITING, Sequence,
                                                    SequenceStatus)


class FCFSPolicy:
    """Oldest request first; priorities are ignored and nobody is pushed out for a newcomer (so
    the scheduler never asks it `may_preempt`)."""

    preempts_for_waiting = False

    @staticmethod
    def key(seq: Sequence) -> tuple:
        return (seq.request.arrival_time, seq.seq_id)


class PriorityPolicy:
    """Lower `priority` value first, then oldest; a waiting request may preempt a running one of
    strictly lower priority (higher value) when blocks are short."""

    preempts_for_waiting = True

    @staticmethod
    def key(seq: Sequence) -> tuple:
        return (seq.request.priority, seq.request.arrival_time, seq.seq_id)

    @staticmethod
    def may_preempt(waiting: Sequence, running: Sequence) -> bool:
        return waiting.request.priority < running.request.priority


POLICIES = {"fcfs": FCFSPolicy, "priority": PriorityPolicy}  # SchedulerConfig checks the name


class SequenceQueues:
    def __init__(self, key: Callable[[Sequence], tuple], max_num_seqs: int) -> None:
        self.key = key
        self.max_num_seqs = max_num_seqs
        # Heaps by policy key; a sequence that left one stays until it reaches the top (`head`).
        self.waiting: list[tuple[tuple, Sequence]] = []
        self.swapped: list[tuple[tuple, Sequence]] = []
        self.running: list[Sequence] = []  # decoding; finished ones dropped at the next step
        self.prefilling: list[Sequence] = []  # admitted, prompt (or recompute) not done yet
        # The next step's running list is built in the last one's: a list that lives on is not
        # traversed again by every young-generation garbage collection.
        self._spare: list[Sequence] = []
        # num_unforked: the room held under max_num_seqs for samples a parent forks once its
        # prompt is done.
        self.num_running = self.num_waiting = self.num_swapped = self.num_unforked = 0

    def room_for(self, num_seqs: int) -> bool:
        """num_seqs more sequences fit under max_num_seqs, counting samples not yet forked."""
        return self.num_running + self.num_unforked + num_seqs <= self.max_num_seqs

    def next_running(self) -> list[Sequence]:
        """An empty list for the step being planned to fill with its decodes."""
        return self._spare

    def planned(self, running: list[Sequence], prefilling: list[Sequence]) -> None:
        """The step's decodes and prompts in progress, in the order the next step takes them."""
        old, self.running, self.prefilling = self.running, running, prefilling
        old.clear()
        self._spare = old

    def victim(self, step_id: int) -> Sequence | None:
        """The sequence to preempt: of the running ones not yet planned in step `step_id`, the
        one with the largest policy key (the latest admitted under the policy goes first)."""
        return max((seq for group in (self.running, self.prefilling) for seq in group
                    if seq.status is RUNNING and seq.last_step != step_id),
                   key=self.key, default=None)

    def head(self, heap: list[tuple[tuple, Sequence]], status: SequenceStatus
             ) -> Sequence | None:
        """The first sequence of `heap` still in `status` (the ones that left are dropped)."""
        while heap and heap[0][1].status is not status:
            heapq.heappop(heap)
        return heap[0][1] if heap else None

    def push_waiting(self, seq: Sequence) -> None:
        seq.moved_to(WAITING)
        self.num_waiting += 1
        heapq.heappush(self.waiting, (self.key(seq), seq))

    def push_swapped(self, seq: Sequence) -> None:
        seq.moved_to(SWAPPED)
        self.num_swapped += 1
        heapq.heappush(self.swapped, (self.key(seq), seq))

    def admit_head(self) -> None:
        """The waiting head (`head` has found it) starts running."""
        self.num_waiting -= 1
        self.start(heapq.heappop(self.waiting)[1])

    def swap_in_head(self) -> None:
        self.num_swapped -= 1
        self.start(heapq.heappop(self.swapped)[1])

    def start(self, seq: Sequence) -> None:
        seq.moved_to(RUNNING)
        self.num_running += 1
        self.num_unforked += seq.request.num_seq_slots - 1

    def forked(self, num_children: int) -> None:
        """A parent's samples forked: they run, in the room held for them."""
        self.num_running += num_children
        self.num_unforked -= num_children

    def leave(self, seq: Sequence) -> None:
        """Before `seq` leaves its queue (preempted or finished): the counts drop."""
        if seq.status is RUNNING:
            self.num_running -= 1
            self.num_unforked -= seq.request.num_seq_slots - 1
        elif seq.status is SWAPPED:
            self.num_swapped -= 1
        elif seq.status is WAITING:
            self.num_waiting -= 1

    def rebuild(self, swapped: list[Sequence], waiting: list[Sequence]) -> None:
        """After the workers lost the device pool: nothing runs, these wait or stay swapped."""
        self.running, self.prefilling, self.swapped, self.waiting = [], [], [], []
        self.num_running = self.num_unforked = self.num_swapped = self.num_waiting = 0
        for seq in swapped:
            self.push_swapped(seq)
        for seq in waiting:
            self.push_waiting(seq)

    def lora_stats(self, max_loras: int) -> dict:
        """vLLM's lora_requests_info: the adapters of running and of waiting (or swapped)
        sequences, by name, and the limit (for /metrics: one stats call a second at most)."""
        running = {seq.request.lora.lora_name for group in (self.running, self.prefilling)
                   for seq in group if seq.status is RUNNING and seq.request.lora is not None}
        waiting = {seq.request.lora.lora_name for heap, status in ((self.waiting, WAITING),
                                                                    (self.swapped, SWAPPED))
                   for _, seq in heap if seq.status is status and seq.request.lora is not None}
        return {"lora_running": sorted(running), "lora_waiting": sorted(waiting),
                "max_lora": max_loras}
