"""Overlapped scheduling: the next step of steady decodes planned while the workers compute
this one.

A step whose every running sequence is a lane (one token each, short of max_tokens: plan.py's
lane_cap) is followed, before its result is back, by a plan of the same lanes one token further.
The workers do not wait for the scheduler's round trip: the moment a step ends they run the
next, each lane's input being the token that rank just sampled for it (StepPlan.ahead; other
ranks of a tensor-parallel group get rank 0's tokens by broadcast). The scheduler learns those
tokens from the first step's result, then counts the second step as in flight exactly as
`schedule()` would have planned it (`promote`).

A lane whose token ahead opens a block takes a free one, as `schedule()` would (never by
preempting: a short pool plans nothing ahead). A block freed while a step is in flight (its
sequence finished or was aborted) may be one of them: the workers run steps in order, so the
step in flight writes what it writes into it before the step ahead's owner writes its own
slots, and an owner reads no slot it has not written. Table rows are not reused while any
step is in flight (`hold_rows`), and no sliding window releases a block ahead.

What the scheduler does not know when it plans ahead is whether a lane finishes on the token
it is sampling (an end-of-sequence or stop id, a stop string, an abort). Such a lane's row of
the step ahead computes one token nobody reads, into a slot of its own blocks: the row is
dropped like any row of a sequence finished while its step ran. A step ahead is only planned
when nothing waits (no queued, swapped or prefilling sequence, no fork or grammar).
Outputs are the same tokens as without overlap; what moves is when they are known.
"""
from __future__ import annotations

from typing import Callable

from pagedserve.pipeline.scheduler.plan import PlanBuilder
from pagedserve.pipeline.scheduler.sequence import Sequence, SequenceStatus

RUNNING = SequenceStatus.RUNNING


def lanes_ahead(inflight: PlanBuilder, running: list[Sequence], num_running: int, kv, *,
                block_size: int, sliding_window: int, max_tokens: int
                ) -> tuple[list[Sequence], list[int]] | None:
    """The lanes of the step after `inflight`, and the indices of those whose token ahead
    opens a block, when that step can only be the same lanes one token on; None otherwise.
    (The scheduler checks first that nothing waits, is swapped out or has a grammar.)"""
    b = inflight
    if b.seqs or b.fork_children or b.swap_out or b.swap_in or b.copy:
        return None
    lanes = [seq for seq in running if seq.status is RUNNING]
    if not lanes or len(lanes) != num_running:
        return None  # a live sequence outside the running list (prefilling): plan it
    step_id = b.step_id
    opening = []
    for index, seq in enumerate(lanes):
        # in the step in flight as a lane, and a lane again with the token it is sampling
        if seq.last_step != step_id:
            return None
        if len(seq.token_ids) + 1 > seq.lane_cap:
            if sliding_window or not _opens_a_block(seq, block_size):
                return None
            opening.append(index)
    if max_tokens < len(lanes) or len(opening) > kv.num_free_blocks:
        return None
    return lanes, opening


def build_ahead(a: PlanBuilder, lanes: list[Sequence], opening: list[int], kv) -> None:
    """Fill the step ahead `a`: the lanes in the decode columns, their tokens left to the
    workers' own samples (-1), a fresh block for each lane in `opening`."""
    a.lanes = lanes
    for index in opening:
        a.lane_blocks.extend((index, block) for block in _open_block(kv, lanes[index]))
    a.lane_ids = [seq.seq_id for seq in lanes]
    a.lane_tokens = [-1] * len(lanes)


def _opens_a_block(seq: Sequence, block_size: int) -> bool:
    """Past its lane_cap only because its token ahead is the first of a new block."""
    n = len(seq.token_ids) + 1
    return (not seq.shared_tail and not seq.needs_full_send
            and seq.lane_cap == seq.num_blocks_sent * block_size == n - 1
            and seq.num_reserved_tokens == n - 1 == seq.num_tokens_sent
            and n <= seq.num_prompt_tokens + seq.request.max_output_tokens - 2)


def _open_block(kv, seq: Sequence) -> list[int]:
    n = len(seq.token_ids) + 1
    blocks = kv.reserve_slots(seq.seq_id, n)
    if not blocks:  # counted free, not shared: the slot bookkeeping is wrong
        raise RuntimeError(f"seq {seq.seq_id}: no block for its token ahead ({blocks})")
    seq.hold_slots(n, reported=True)
    seq.sent_blocks_upto(seq.num_blocks_sent + len(blocks))
    return blocks


def promote(a: PlanBuilder, lane_cap: Callable[[Sequence], int], *, block_size: int,
            caching: bool) -> int:
    """The step in flight is over and applied: the step ahead `a` is the one in flight now,
    each lane still running counted as `_schedule_running` counts a lane it plans (`lane_cap`
    gives a lane that opened a block its new cap). Returns the step's token count."""
    step_id = a.step_id
    opened = {index for index, _ in a.lane_blocks}
    for index, seq in enumerate(a.lanes):
        if seq.status is not RUNNING:
            a.num_finished += 1  # finished on the token it sampled: its row is dropped
            continue
        n = len(seq.token_ids)
        seq.plan_lane(step_id, n)
        if index in opened:
            seq.lanes_until(lane_cap(seq))
        if caching and not n % block_size:
            a.lane_fills.append(seq)
    return len(a.lanes)
