"""One step's plan as the scheduler builds it: a diff against what the workers hold.

The scheduler decides, for each sequence it plans, how many tokens it computes; `PlanBuilder`
records each decision in the plan's encoding. A sequence joins the plan with only what the
workers lack: everything (`NewSeq`) when they hold nothing valid for it, else its new tokens
and blocks (`ScheduledSeq`). The steady case - a one-token decode whose slot lies in blocks
the workers hold and whose token cannot end it by length - is encoded as a *lane*: a column
entry (`decode_seq_ids` / `decode_token_ids`, a fresh block in `decode_new_blocks`) instead of
an object per sequence. Lanes are an encoding of the same decision, not a second policy:
`SchedulerConfig.decode_lanes=False` plans every step through the general path, and
tests/pipeline/test_scheduler_lane_equivalence.py checks that both give the same plans,
outputs and block tables.
"""
from __future__ import annotations

from pagedserve.pipeline.messages import (Fork, NewSeq, ScheduledSeq, SharedTables, StepPlan,
                                          StepResult)
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
        self.add_scheduled(seq, ScheduledSeq(new.seq_id, num_tokens, NO_BLOCKS, [], drafts)
                           if drafts else ScheduledSeq(new.seq_id, num_tokens, NO_BLOCKS, []))

    def add_scheduled(self, seq: Sequence, entry: ScheduledSeq) -> None:
        self.scheduled.append(entry)
        self.seqs.append(seq)
        self.budget -= entry.num_tokens + len(entry.draft_token_ids)

    def add_lane_blocks(self, blocks: list[int]) -> None:
        """Blocks the lane about to be added appends before it computes."""
        index = len(self.lanes)
        for block in blocks:
            self.lane_blocks.append((index, block))

    def build(self, finished_seq_ids: list[int], shared_tables: SharedTables | None) -> StepPlan:
        self.plan = StepPlan(self.step_id, self.new_seqs, self.scheduled, self.swap_out, self.swap_in,
                        self.copy, self.forks, finished_seq_ids, shared_tables, self.lane_ids,
                        self.lane_tokens, self.lane_blocks)
        return self.plan


def lane_cap(seq: Sequence, block_size: int) -> int:
    """For a sequence just planned to compute up to the end of its tokens: the largest token
    count at which its following steps are lanes. A lane's slot lies in the blocks the workers
    hold (not a shared last block), the workers need nothing else about it, and the token it
    samples leaves it short of max_tokens (so `update` need not check the length). -1: none."""
    n = len(seq.token_ids)
    if (seq.shared_tail or seq.needs_full_send or seq.num_reserved_tokens != n
            or seq.num_tokens_sent != n):
        return -1
    return min(seq.num_blocks_sent * block_size,
               seq.num_prompt_tokens + seq.request.max_output_tokens - 2)


class ResultRows:
    """A sequence's row in a StepResult, for rows not in plan order (workers answer in plan
    order, so results are found with a cursor and this index is rarely built)."""

    __slots__ = ("result", "index")

    def __init__(self, result: StepResult) -> None:
        if len(result.token_ids) != len(result.seq_ids):
            raise ValueError(f"StepResult for step {result.step_id} has {len(result.seq_ids)} "
                             f"seq_ids but {len(result.token_ids)} token_ids")
        self.result = result
        self.index: dict[int, int] | None = None

    def find(self, seq_id: int) -> int:
        if self.index is None:
            self.index = {sid: r for r, sid in enumerate(self.result.seq_ids)}
        row = self.index.get(seq_id)
        if row is None:
            raise ValueError(f"StepResult for step {self.result.step_id} has no token for "
                             f"sequence {seq_id}, which reached the end of its tokens")
        return row
