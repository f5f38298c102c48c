"""One step's plan as the scheduler builds it: a diff against what the workers hold, each
decision in the plan's encoding - a `NewSeq`, a `ScheduledSeq` or a lane (docs/INTERFACES.md,
"Decode lanes are the plan's encoding, not a second policy").
"""
from __future__ import annotations

from pagedserve.pipeline.messages import Fork, NewSeq, ScheduledSeq, SharedTables, StepPlan
from pagedserve.pipeline.scheduler.sequence import Sequence

# The new_block_ids of every decode that adds no block (most of them). Plans are messages: no
# consumer mutates them, so one shared empty list spares an allocation (and GC work) per sequence.
NO_BLOCKS: list[int] = []


class PlanBuilder:
    """The lists of one step's plan, the token budget left, and the sequences it plans (which
    `update` advances once the result is back)."""

    __slots__ = ("step_id", "budget", "new_seqs", "scheduled", "swap_out", "swap_in", "copy",
                 "forks", "lanes", "lane_ids", "lane_tokens", "lane_blocks", "lane_fills", "seqs",
                 "fork_children", "num_finished", "verified", "plan")

    def __init__(self, step_id: int, budget: int) -> None:
        self.step_id = step_id
        self.budget = budget
        self.new_seqs: list[NewSeq] = []
        self.scheduled: list[ScheduledSeq] = []
        self.swap_out: list[tuple[int, int]] = []
        self.swap_in: list[tuple[int, int]] = []
        self.copy: list[tuple[int, int]] = []
        self.forks: list[Fork] = []
        # The planned sequences in plan (and result-row) order: the lanes (the plan's decode
        # columns lane_ids / lane_tokens), then seqs (one ScheduledSeq each).
        self.lanes: list[Sequence] = []
        self.lane_ids: list[int] = []
        self.lane_tokens: list[int] = []
        self.lane_blocks: list[tuple[int, int]] = []  # (lane index, block id it appends)
        self.lane_fills: list[Sequence] = []  # lanes whose computed token fills their block
        self.seqs: list[Sequence] = []
        self.fork_children: list[Sequence] = []
        self.num_finished = 0  # planned sequences finished (aborted, stopped) while in flight
        self.verified: list[tuple[int, int]] = []  # (drafts, accepted) per speculating sequence
        self.plan: StepPlan | None = None  # the message built, once built

    def add_full(self, seq: Sequence, new: NewSeq, num_tokens: int,
                 drafts: list[int] = NO_BLOCKS) -> None:
        """`seq` computes `num_tokens` (and `drafts`) from state sent in full."""
        self.new_seqs.append(new)
        self.add_scheduled(seq, ScheduledSeq(new.seq_id, num_tokens, NO_BLOCKS, [], drafts))

    def add_scheduled(self, seq: Sequence, entry: ScheduledSeq) -> None:
        self.scheduled.append(entry)
        self.seqs.append(seq)
        self.budget -= entry.num_tokens + len(entry.draft_token_ids)

    def build(self, finished_seq_ids: list[int], shared_tables: SharedTables | None) -> StepPlan:
        self.plan = StepPlan(self.step_id, self.new_seqs, self.scheduled, self.swap_out,
                             self.swap_in, self.copy, self.forks, finished_seq_ids, shared_tables,
                             self.lane_ids, self.lane_tokens, self.lane_blocks)
        return self.plan

