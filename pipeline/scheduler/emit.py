"""Plan diffs: a sequence joins a step's plan with only what the workers do not hold yet.

`emit` is the general path (the lanes in decode.py are its fast equivalent); the step that
completes a prompt forks its other samples (`fork_samples`). Both take the Scheduler, whose
state they change.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.pipeline.messages import Fork, NewSeq, ScheduledSeq
from pagedserve.pipeline.scheduler.decode import PlanBuilder, lane_cap
from pagedserve.pipeline.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from pagedserve.pipeline.scheduler.scheduler import Scheduler

RUNNING = SequenceStatus.RUNNING


def emit(sched: Scheduler, seq: Sequence, num_tokens: int, b: PlanBuilder) -> None:
    """Add `seq` computing `num_tokens` to the plan, sending only what the workers lack."""
    sid, tokens = seq.seq_id, seq.token_ids
    if seq.needs_full_send:
        block_ids = sched.kv.block_table(sid)
        npr = seq.num_prompt_tokens
        b.new_seqs.append(NewSeq(sid, tokens[:npr], tokens[npr:],
                                 seq.request.sampling.for_sample(seq.index),
                                 block_ids, seq.num_computed_tokens, sched.kv.row_of(sid)))
        seq.needs_full_send = False
        seq.num_blocks_sent = len(block_ids)
        seq.num_tokens_sent = len(tokens)
        b.scheduled.append(ScheduledSeq(sid, num_tokens, [], []))
    else:
        num_blocks = (seq.num_reserved_tokens + sched.block_size - 1) // sched.block_size
        if num_blocks > seq.num_blocks_sent:
            new_blocks = sched.kv.block_table(sid)[seq.num_blocks_sent:]
            seq.num_blocks_sent = num_blocks
        else:
            new_blocks = []
        b.scheduled.append(ScheduledSeq(sid, num_tokens, new_blocks,
                                        tokens[seq.num_tokens_sent:]))
        seq.num_tokens_sent = len(tokens)
    seq.step_tokens = num_tokens
    seq.last_step = b.step_id
    b.seqs.append(seq)
    b.budget -= num_tokens
    if seq.num_computed_tokens + num_tokens == len(tokens):  # it samples
        if not seq.request.forked:
            fork_samples(sched, seq, b)
        seq.lane_cap = lane_cap(seq, sched.block_size)
    else:
        seq.lane_cap = -1


def fork_samples(sched: Scheduler, parent: Sequence, b: PlanBuilder) -> None:
    """The step that completes the parent's prompt: its n - 1 siblings share every block
    and sample from the same logits."""
    req = parent.request
    req.forked = True
    sched._sync_kv(parent)
    parent.shared_tail = True
    children = []
    for index in range(1, req.sampling.n):
        child = sched._new_seq(req, index, parent.token_ids[:])
        sched.kv.fork(parent.seq_id, child.seq_id)
        child.parent_id = parent.seq_id
        child.status = RUNNING
        child.num_computed_tokens = parent.num_computed_tokens + parent.step_tokens
        child.num_reserved_tokens = child.num_kv_tokens = parent.num_reserved_tokens
        child.shared_tail = True
        child.needs_full_send = False  # the workers copy the parent's state
        child.num_tokens_sent = parent.num_tokens_sent
        child.num_blocks_sent = parent.num_blocks_sent
        child.last_step = b.step_id
        children.append(child)
    sched.num_running += len(children)
    sched.num_unforked -= len(children)
    rows = [sched.kv.row_of(c.seq_id) for c in children] if sched._shared_tables else []
    b.forks.append(Fork(parent.seq_id, [c.seq_id for c in children], rows))
    b.fork_children.extend(children)
