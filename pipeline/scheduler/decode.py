"""The scheduler's per-sequence hot loops, run for every running sequence on every step.

`schedule_running` plans one token for each decoding sequence and `apply_result` applies the
sampled tokens in `update`. The steady case - a decode whose token cannot end it by length,
with nothing to send but that token and, at a block boundary, a fresh block - is a *lane*.
While ``len(token_ids) <= seq.lane_cap`` (set by `lane_cap` whenever the sequence is planned
any other way) a sequence goes into the plan's decode columns with a handful of attribute
writes, its token counted as computed right away; `update` appends the lanes' sampled tokens
with one C-level map and hands them on as StepOutputs' columns, with no message object per
sequence either way. Anything else goes to the scheduler's general methods, at the same point
in the order, so plans and outputs are exactly what those give.
"""
from __future__ import annotations

from collections import deque
from operator import attrgetter
from typing import TYPE_CHECKING

from pagedserve.pipeline.messages import Fork, NewSeq, ScheduledSeq, StepResult
from pagedserve.pipeline.sequence import Sequence, SequenceOutput, SequenceStatus, StepOutputs

if TYPE_CHECKING:
    from pagedserve.pipeline.scheduler.scheduler import Scheduler

RUNNING = SequenceStatus.RUNNING
# The new_block_ids of every decode that adds no block (most of them). Plans are messages: no
# consumer mutates them, so one shared empty list spares an allocation (and GC work) per sequence.
NO_BLOCKS: list[int] = []
_TOKEN_IDS = attrgetter("token_ids")
_SEQ_ID = attrgetter("seq_id")


class PlanBuilder:
    """The lists of one step's plan, plus the token budget left."""

    __slots__ = ("step_id", "budget", "new_seqs", "scheduled", "swap_out", "swap_in", "copy",
                 "forks", "lanes", "lane_ids", "lane_tokens", "lane_blocks", "lane_fills", "seqs",
                 "fork_children", "num_finished")

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
    running list from this step on) and records the planned ones in `b`.

    Lanes go to the decode columns right here; every other sequence goes through
    `_schedule_off_lane`, at the same point in the order, and may turn out a lane after all.
    """
    keep = new_running.append
    lanes = b.lanes
    add_lane, add_lane_token = lanes.append, b.lane_tokens.append
    add_fill = b.lane_fills.append
    bs, step_id = sched.block_size, b.step_id
    caching = sched.config.enable_prefix_caching
    budget = b.budget
    for seq in sched.running:
        tokens = seq.token_ids
        n = len(tokens)
        if n > seq.lane_cap or budget <= 0:  # not a lane (a finished or preempted one's is -1)
            b.budget = budget
            is_lane = _schedule_off_lane(sched, seq, b, keep)
            budget = b.budget
            if not is_lane:
                continue
        add_lane(seq)
        add_lane_token(tokens[-1])
        # A lane's token counts as computed from the moment it is planned (nothing reads the
        # count before the result is back, and a lost step recomputes everything).
        seq.num_reserved_tokens = seq.num_tokens_sent = seq.num_computed_tokens = n
        seq.last_step = step_id
        if caching and not n % bs:
            add_fill(seq)
        budget -= 1
        keep(seq)
    b.budget = budget
    b.lane_ids = list(map(_SEQ_ID, lanes))


def _schedule_off_lane(sched: Scheduler, seq: Sequence, b: PlanBuilder, keep) -> bool:
    """A running sequence past its lane_cap (or with no budget left): skipped if it finished or
    was preempted meanwhile, else planned here or by the general path. True when it is a lane
    after all, for the caller to add to the decode columns.

    A decode whose slot needs a new block takes it from `reserve_slots` here (a shared last
    block or a short pool fails that) and is a lane too, its block in the plan's
    decode_new_blocks, unless the token it samples may end it by length; anything else (no
    budget, a recompute catching up, a resend, a copy-on-write, preemptions) goes to
    `sched._schedule_one_running`.
    """
    if seq.status is not RUNNING:
        return False  # finished or preempted since
    n = len(seq.token_ids)
    if (seq.num_computed_tokens + 1 != n or seq.num_reserved_tokens >= n
            or seq.needs_full_send or b.budget <= 0):
        sched._schedule_one_running(seq, b, keep)
        return False
    bs = sched.block_size
    if n <= seq.num_blocks_sent * bs and not seq.shared_tail:
        new_blocks = NO_BLOCKS  # inside the blocks the workers hold: tell the manager later
    else:
        new_blocks = sched.kv.reserve_slots(seq.seq_id, n)
        if new_blocks is None:  # its last block is shared, or the pool is short
            sched._schedule_one_running(seq, b, keep)
            return False
        seq.num_kv_tokens = n
        seq.shared_tail = False
        seq.num_blocks_sent += len(new_blocks)
    seq.num_reserved_tokens = n
    if not (new_blocks and seq.num_tokens_sent + 1 == n
            and n <= seq.num_prompt_tokens + seq.request.max_output_tokens - 2):
        _schedule_decode(seq, new_blocks, b, bs)
        keep(seq)
        return False
    # A lane that opens a new block (the common boundary case): on with the lanes.
    seq.num_tokens_sent = n
    index = len(b.lanes)
    for block in new_blocks:
        b.lane_blocks.append((index, block))
    seq.lane_cap = lane_cap(seq, bs)
    return True


def _schedule_decode(seq: Sequence, new_blocks: list[int], b: PlanBuilder, bs: int) -> None:
    """A one-token decode that is not a lane: a ScheduledSeq with its unsent tokens."""
    tokens, n, sent = seq.token_ids, len(seq.token_ids), seq.num_tokens_sent
    seq.num_tokens_sent = n
    b.scheduled.append(ScheduledSeq(seq.seq_id, 1, new_blocks,
                                    [tokens[sent]] if sent + 1 == n else tokens[sent:]))
    b.seqs.append(seq)
    seq.step_tokens = 1
    seq.last_step = b.step_id
    seq.lane_cap = lane_cap(seq, bs)
    b.budget -= 1


def apply_result(sched: Scheduler, b: PlanBuilder, result: StepResult) -> StepOutputs:
    """Advance every planned sequence by the tokens it computed and append its sampled token;
    returns the outputs (the plain ones as columns, the rest in plan order, fork children
    last), stop rules applied."""
    rows = ResultRows(result)
    seq_ids, token_ids = result.seq_ids, result.token_ids
    lanes = b.lanes
    num_lanes = len(lanes)
    out = StepOutputs([], [], [])
    plain = result.logprobs is None and result.top_logprobs is None
    if plain and not b.num_finished and seq_ids[:num_lanes] == b.lane_ids:
        _apply_lanes(sched, b, token_ids, result, out)
    else:  # logprobs to pass on, rows out of order, or lanes gone meanwhile
        _apply_lanes_one_by_one(sched, lanes, rows, plain, out)
    _apply_general(sched, b.seqs, rows, num_lanes, plain, out)
    others, finish_sampled = out.others, sched._finish_sampled
    for seq in b.fork_children:
        if seq.status is RUNNING:
            row = rows.find(seq.seq_id)
            token = token_ids[row]
            seq.token_ids.append(token)
            others.append(finish_sampled(seq, token, row, result))
    return out


def _apply_lanes(sched: Scheduler, b: PlanBuilder, token_ids: list[int], result: StepResult,
                 out: StepOutputs) -> None:
    """The common case: every lane is still running and its row is where the plan put it (the
    first len(lanes) rows). Each lane's token was counted as computed when it was planned, and
    a lane cannot reach max_tokens, so what is left is appending the sampled tokens (in C, by
    map), making the blocks that filled up findable, and finishing lanes that sampled a stop
    id. The output columns are the lanes list itself and the rows' tokens."""
    lanes = b.lanes
    num_lanes = len(lanes)
    deque(map(list.append, map(_TOKEN_IDS, lanes), token_ids), 0)
    if b.lane_fills:  # before a stop below frees its blocks
        # (the slots of the block that filled may have been held lazily: report them too)
        sched.kv.commit_blocks([(seq.seq_id, seq.token_ids, seq.num_computed_tokens,
                                 seq.num_computed_tokens) for seq in b.lane_fills])
        for seq in b.lane_fills:
            seq.num_kv_tokens = seq.num_computed_tokens
    tokens = token_ids[:num_lanes]
    if sched.stop_id_union.isdisjoint(tokens):
        out.seqs, out.token_ids = lanes, tokens
        return
    finish_sampled, others = sched._finish_sampled, out.others
    stopped = set()
    for row, seq in enumerate(lanes):
        token = tokens[row]
        if token in seq.request.stop_ids:
            others.append(finish_sampled(seq, token, row, result))
            stopped.add(row)
    out.seqs = [seq for row, seq in enumerate(lanes) if row not in stopped]
    out.token_ids = [t for row, t in enumerate(tokens) if row not in stopped]


def _apply_lanes_one_by_one(sched: Scheduler, lanes: list[Sequence], rows: ResultRows,
                            plain: bool, out: StepOutputs) -> None:
    """The lanes' rows wherever they are, skipping lanes finished meanwhile, with logprobs."""
    result = rows.result
    seq_ids, token_ids = result.seq_ids, result.token_ids
    bs = sched.block_size
    caching = sched.config.enable_prefix_caching
    commit, finish_sampled = sched.kv.commit_blocks, sched._finish_sampled
    filled = []
    for row, seq in enumerate(lanes):
        if seq.status is not RUNNING:
            continue  # aborted or stopped while the step ran
        if row >= len(seq_ids) or seq_ids[row] != seq.seq_id:
            row = rows.find(seq.seq_id)
        new = seq.num_computed_tokens  # counted when planned
        tokens = seq.token_ids
        if caching and not new % bs:  # a block filled up: make it findable
            filled.append((seq.seq_id, tokens, new, new))
            seq.num_kv_tokens = new
        token = token_ids[row]
        tokens.append(token)
        if plain and token not in seq.request.stop_ids:
            out.seqs.append(seq)
            out.token_ids.append(token)
        else:
            if filled:  # in order, and before a finished sequence frees its blocks
                commit(filled)
                filled = []
            out.others.append(finish_sampled(seq, token, row, result))
    if filled:
        commit(filled)


def _apply_general(sched: Scheduler, seqs: list[Sequence], rows: ResultRows, cursor: int,
                   plain: bool, out: StepOutputs) -> None:
    """Any planned sequences, in plan order, from result row `cursor` on."""
    result = rows.result
    bs = sched.block_size
    caching = sched.config.enable_prefix_caching
    commit, finish_sampled = sched.kv.commit_blocks, sched._finish_sampled
    # Rows come in plan order: a cursor finds them, the index only what is out of order. The
    # sentinel ends the rows without a bounds check per sequence.
    seq_ids, token_ids = [*result.seq_ids, None], result.token_ids
    running = RUNNING
    filled = []  # (seq_id, tokens, slots held, computed) of sequences whose block filled up
    plain_seqs, plain_tokens = [], []
    for seq in seqs:
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
            plain_seqs.append(seq)
            plain_tokens.append(token)
        else:
            if filled:  # in order, and before a finished sequence frees its blocks
                commit(filled)
                filled = []
            out.others.append(finish_sampled(seq, token, cursor - 1, result))
    if filled:
        commit(filled)
    if plain_seqs:
        out.seqs = out.seqs + plain_seqs
        out.token_ids = out.token_ids + plain_tokens
