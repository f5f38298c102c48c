"""The scheduler's per-sequence hot loops, run for every running sequence on every step.

`schedule_running` plans one token for each decoding sequence and `apply_result` applies the
sampled tokens in `update`. Both inline the common case (a decode in a sequence's own blocks,
nothing to resend, no preemption, no stop) with every attribute looked up once, and hand anything
else to the scheduler's general methods, so plans and outputs are exactly what those give.
"""
from __future__ import annotations

from itertools import chain, islice
from typing import TYPE_CHECKING

from pipeline.messages import Fork, NewSeq, ScheduledSeq, StepResult
from pipeline.sequence import Sequence, SequenceOutput, SequenceStatus

if TYPE_CHECKING:
    from pipeline.scheduler.scheduler import Scheduler

RUNNING = SequenceStatus.RUNNING
# The new_block_ids of every decode that adds no block (most of them). Plans are messages: no
# consumer mutates them, so one shared empty list spares an allocation (and GC work) per sequence.
NO_BLOCKS: list[int] = []


class PlanBuilder:
    """The lists of one step's plan, plus the token budget left."""

    __slots__ = ("step_id", "budget", "new_seqs", "scheduled", "swap_out", "swap_in", "copy",
                 "forks", "decoded", "num_decoded", "seqs", "fork_children")

    def __init__(self, step_id: int, budget: int) -> None:
        self.step_id = step_id
        self.budget = budget
        self.new_seqs: list[NewSeq] = []
        self.scheduled: list[ScheduledSeq] = []
        self.swap_out: list[tuple[int, int]] = []
        self.swap_in: list[tuple[int, int]] = []
        self.copy: list[tuple[int, int]] = []
        self.forks: list[Fork] = []
        # The planned sequences, in plan order: decoded[:num_decoded] (the running list, when
        # every running sequence kept was planned), then seqs.
        self.decoded: list[Sequence] = []
        self.num_decoded = 0
        self.seqs: list[Sequence] = []
        self.fork_children: list[Sequence] = []


class ResultRows:
    """A sequence's row in a StepResult, for rows not in plan order (workers answer in plan
    order, so `apply_result` finds almost every row with a cursor and never builds this index)."""

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


def schedule_running(sched: Scheduler, b: PlanBuilder, new_running: list[Sequence]) -> None:
    """One token for every decoding sequence, in running order; fills `new_running` (the
    running list from this step on) and records the planned ones, in plan order, in `b`.

    The fast case: computing its last sampled token (one new slot) with nothing to resend.
    The slot lies in the blocks the workers already have (held lazily, reported to the manager
    later) or takes new blocks from `reserve_slots`; anything else (no budget, a recompute
    catching up, a copy-on-write, a short pool and its preemptions) goes to
    `sched._schedule_one_running`, at the same point in the order.
    """
    reserve = sched.kv.reserve_slots
    general = sched._schedule_one_running
    add, keep = b.scheduled.append, new_running.append
    bs, step_id, running = sched.block_size, b.step_id, RUNNING
    budget = b.budget
    for seq in sched.running:
        if seq.status is not running:
            continue  # finished or preempted since
        tokens = seq.token_ids
        n = len(tokens)
        if (seq.num_computed_tokens + 1 != n or seq.num_reserved_tokens >= n
                or seq.needs_full_send or budget <= 0):
            b.budget = budget
            general(seq, b, keep)
            budget = b.budget
            continue
        if n <= seq.num_blocks_sent * bs and not seq.shared_tail:
            new_blocks = NO_BLOCKS  # inside the blocks the workers hold: tell the manager later
        else:
            new_blocks = reserve(seq.seq_id, n)
            if new_blocks is None:  # its last block is shared, or the pool is short
                b.budget = budget
                general(seq, b, keep)
                budget = b.budget
                continue
            seq.num_kv_tokens = n
            seq.shared_tail = False
            seq.num_blocks_sent += len(new_blocks)
        seq.num_reserved_tokens = n
        sent = seq.num_tokens_sent
        add(ScheduledSeq(seq.seq_id, 1, new_blocks,
                         [tokens[sent]] if sent + 1 == n else tokens[sent:]))
        seq.num_tokens_sent = n
        seq.step_tokens = 1
        seq.last_step = step_id
        budget -= 1
        keep(seq)
    b.budget = budget
    # Every planned sequence was kept (nothing preempts what this step already planned), in
    # plan order, so when none was kept unplanned the kept ones are b.seqs.
    if len(b.scheduled) == len(new_running):
        b.decoded, b.num_decoded = new_running, len(new_running)
        b.seqs = []
    else:  # some were kept without being planned (no budget left, nothing to compute)
        b.seqs = [seq for seq in new_running if seq.last_step == step_id]


def apply_result(sched: Scheduler, b: PlanBuilder, result: StepResult) -> list[SequenceOutput]:
    """Advance every planned sequence by the tokens it computed and append its sampled token;
    returns the outputs in plan order (fork children last), stop rules applied."""
    outputs: list[SequenceOutput] = []
    rows = ResultRows(result)
    bs = sched.block_size
    caching = sched.config.enable_prefix_caching
    commit, finish_sampled = sched.kv.commit_blocks, sched._finish_sampled
    emit = outputs.append
    plain = result.logprobs is None and result.top_logprobs is None
    # Rows come in plan order: a cursor finds them, the index only what is out of order. The
    # sentinel ends the rows without a bounds check per sequence.
    seq_ids, token_ids = [*result.seq_ids, None], result.token_ids
    cursor = 0
    running = RUNNING
    filled = []  # (seq_id, tokens, slots held, computed) of sequences whose block filled up
    for seq in chain(islice(b.decoded, b.num_decoded), b.seqs):
        if seq.status is not running:
            continue  # aborted or stopped while the step ran
        step = seq.step_tokens
        new = seq.num_computed_tokens = seq.num_computed_tokens + step
        tokens = seq.token_ids
        if caching and new % bs < step:  # a block filled up: make it findable
            held = seq.num_kv_tokens
            if new > held:  # report the slots held lazily too
                held = seq.num_kv_tokens = seq.num_reserved_tokens
            filled.append((seq.seq_id, tokens, held, new))
        if new != len(tokens):
            continue  # mid-prefill or catching up after a recompute: nothing sampled
        if seq_ids[cursor] != seq.seq_id:
            cursor = rows.find(seq.seq_id)
        token = token_ids[cursor]
        cursor += 1
        tokens.append(token)
        req = seq.request
        if (plain and token not in req.stop_ids
                and new - seq.num_prompt_tokens + 1 < req.max_output_tokens):
            emit(SequenceOutput(req.request_id, seq.index, [token]))
        else:
            if filled:  # in order, and before a finished sequence frees its blocks
                commit(filled)
                filled = []
            emit(finish_sampled(seq, token, cursor - 1, result))
    if filled:
        commit(filled)
    for seq in b.fork_children:
        if seq.status is running:
            row = rows.find(seq.seq_id)
            token = token_ids[row]
            seq.token_ids.append(token)
            emit(finish_sampled(seq, token, row, result))
    return outputs

