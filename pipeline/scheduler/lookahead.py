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

from pagedserve.pipeline.messages import StepPlan
from pagedserve.pipeline.scheduler.plan import PlanBuilder
from pagedserve.pipeline.scheduler.sequence import SequenceStatus

RUNNING = SequenceStatus.RUNNING


def plan_ahead(sched) -> StepPlan | None:
    """The step after the one in flight, if it can only be the same lanes one token on; None
    (nothing planned) otherwise, and the next step is planned from its result as usual."""
    b = sched._inflight
    if (b is None or sched._ahead is not None or not sched.config.decode_lanes or b.seqs
            or b.fork_children or b.swap_out or b.swap_in or b.copy
            or sched.num_waiting or sched.num_swapped
            or (sched.grammar_book is not None and sched.grammar_book.grammars)):
        return None
    lanes = [seq for seq in sched.running if seq.status is RUNNING]
    if not lanes or len(lanes) != sched.num_running:
        return None  # a live sequence outside the running list (prefilling): plan it
    step_id = b.step_id
    opening = []  # the lanes whose token ahead opens a block, by index
    for index, seq in enumerate(lanes):
        # in the step in flight as a lane, and a lane again with the token it is sampling
        if seq.last_step != step_id:
            return None
        if len(seq.token_ids) + 1 > seq.lane_cap:
            if not _opens_a_block(sched, seq):
                return None
            opening.append(index)
    budget = sched.config.max_num_batched_tokens - len(lanes)
    if budget < 0 or len(opening) > sched.kv.num_free_blocks:
        return None
    a = PlanBuilder(sched._next_step_id, budget)
    sched._next_step_id += 1
    a.lanes = lanes
    for index in opening:
        a.lane_blocks.extend((index, block) for block in _open_block(sched.kv, lanes[index]))
    a.lane_ids = [seq.seq_id for seq in lanes]
    a.lane_tokens = [-1] * len(lanes)  # the workers' own samples of the step before
    finished, sched._finished_seq_ids = sched._finished_seq_ids, []
    sched._ahead = a
    sched.num_steps_ahead += 1
    plan = a.build(finished, sched._shared_tables)
    plan.ahead = True
    return plan


def _opens_a_block(sched, seq) -> bool:
    """Past its lane_cap only because its token ahead is the first of a new block."""
    n = len(seq.token_ids) + 1
    return (not sched.sliding_window and not seq.shared_tail and not seq.needs_full_send
            and seq.lane_cap == seq.num_blocks_sent * sched.block_size == n - 1
            and seq.num_reserved_tokens == n - 1 == seq.num_tokens_sent
            and n <= seq.num_prompt_tokens + seq.request.max_output_tokens - 2)


def _open_block(kv, seq) -> list[int]:
    n = len(seq.token_ids) + 1
    blocks = kv.reserve_slots(seq.seq_id, n)
    if not blocks:  # counted free, not shared: the slot bookkeeping is wrong
        raise RuntimeError(f"seq {seq.seq_id}: no block for its token ahead ({blocks})")
    seq.hold_slots(n, reported=True)
    seq.sent_blocks_upto(seq.num_blocks_sent + len(blocks))
    return blocks


def promote(sched) -> None:
    """The step in flight is over and applied: the step planned ahead is the one in flight
    now, each lane still running counted as `_schedule_running` counts a lane it plans."""
    a, sched._ahead = sched._ahead, None
    sched._inflight = a
    step_id, block_size = a.step_id, sched.block_size
    caching = sched.config.enable_prefix_caching
    opened = {index for index, _ in a.lane_blocks}
    for index, seq in enumerate(a.lanes):
        if seq.status is not RUNNING:
            a.num_finished += 1  # finished on the token it sampled: its row is dropped
            continue
        n = seq.plan_lane(step_id)
        if index in opened:
            seq.lanes_until(sched._lane_cap(seq))
        if caching and not n % block_size:
            a.lane_fills.append(seq)
    sched.iteration_tokens = len(a.lanes)
