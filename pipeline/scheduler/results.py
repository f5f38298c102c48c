"""Reading a step's result back into the sequences the plan handed to the workers
(docs/INTERFACES.md, `results.py`). Two loops, one meaning: `_advance_lanes` is the common case
of the decode columns, done with one C-level map; `_advance_each` is everything else.
"""
from __future__ import annotations

from collections import deque
from operator import attrgetter, itemgetter

from pagedserve.pipeline.messages import StepResult
from pagedserve.pipeline.scheduler.plan import PlanBuilder
from pagedserve.pipeline.scheduler.sequence import RUNNING, Sequence
from pagedserve.pipeline.scheduler.step_outputs import StepOutputs

NO_DRAFTS: list[int] = []

# (sequence, its sampled token, its row in the result) for the scheduler to apply stop rules to
Sampled = tuple[Sequence, int, int]


def advance(b: PlanBuilder, result: StepResult, kv, *, block_size: int, caching: bool,
            stop_id_union: set[int]) -> tuple[StepOutputs, list[Sampled], list[Sequence]]:
    """What it returns: docs/INTERFACES.md. `stop_id_union` holds every stop id of every request:
    a step of lanes none of whose tokens is in it stops nothing."""
    rows = ResultRows(result)
    lanes = b.lanes
    out = StepOutputs([], [], [])
    pending: list[Sampled] = []
    pooled: list[Sequence] = []
    # (seq_id, tokens, slots held, computed) per block that filled up; None: no prefix caching
    fills: list[tuple[int, list[int], int, int]] | None = [] if caching else None
    plain = result.logprobs is None and result.top_logprobs is None
    if plain and not b.num_finished and result.seq_ids[:len(lanes)] == b.lane_ids:
        _advance_lanes(b, result.token_ids, out, pending, fills, stop_id_union)
    else:  # logprobs to pass on, rows out of order, or lanes finished meanwhile
        _advance_each(lanes, rows, 0, True, plain, out, pending, pooled, block_size, fills,
                      b.verified)
    _advance_each(b.seqs, rows, len(lanes), False, plain, out, pending, pooled, block_size,
                  fills, b.verified)
    for seq in b.fork_children:
        if seq.status is RUNNING:
            row = rows.find(seq.seq_id)
            token = result.token_ids[row]
            seq.token_ids.append(token)
            pending.append((seq, token, row))
    if fills:
        fills.sort(key=itemgetter(0))
        kv.commit_blocks(fills)
    return out, pending, pooled


def _advance_lanes(b: PlanBuilder, token_ids: list[int], out: StepOutputs,
                   pending: list[Sampled], fills: list | None, stop_id_union: set[int]) -> None:
    """Every lane is still running and its row is where the plan put it (the first len(lanes)
    rows). Each lane's token was counted as computed when it was planned, and a lane cannot
    reach max_tokens: what is left is appending the sampled tokens (in C, by map), noting the
    blocks that filled up, and setting aside lanes that sampled one of their stop ids. The
    output columns are the lanes list itself and the rows' tokens."""
    lanes = b.lanes
    deque(map(list.append, map(attrgetter("token_ids"), lanes), token_ids), 0)
    if fills is not None:
        for seq in b.lane_fills:  # the slots of the filled block may have been held lazily
            new = seq.num_computed_tokens
            held = seq.num_kv_tokens  # beyond `new` when a step ahead opened its next block
            if held < new:
                held = seq.reported_slots(new)
            fills.append((seq.seq_id, seq.token_ids, held, new))
    tokens = token_ids[:len(lanes)]
    if stop_id_union.isdisjoint(tokens):
        out.seqs, out.token_ids = lanes, tokens
        return
    for row, (seq, token) in enumerate(zip(lanes, tokens)):
        if token in seq.request.stop_ids:
            pending.append((seq, token, row))
        else:
            out.seqs.append(seq)
            out.token_ids.append(token)


def _advance_each(seqs: list[Sequence], rows: ResultRows, cursor: int, counted: bool,
                  plain: bool, out: StepOutputs, pending: list[Sampled], pooled: list[Sequence],
                  block_size: int, fills: list | None, verified: list[tuple[int, int]]) -> None:
    """Planned sequences in plan order, from result row `cursor` on. `counted`: the lanes,
    whose one token was counted as computed when they were planned. A sequence that had
    drafts gains those rank 0 accepted before its sampled token (spec_skip of them), always
    passed on to the scheduler; (drafts, accepted) go to `verified`."""
    result = rows.result
    # Rows come in plan order: a cursor finds them, the index only what is out of order. The
    # sentinel ends the rows without a bounds check per sequence.
    seq_ids, token_ids = [*result.seq_ids, None], result.token_ids
    running = RUNNING
    plain_seqs, plain_tokens = [], []
    for seq in seqs:
        if seq.status is not running:
            continue  # aborted or stopped while the step ran
        if counted:
            step, new = 1, seq.num_computed_tokens
        else:
            step = seq.step_tokens
            new = seq.computed(step)
        tokens = seq.token_ids
        if seq.drafts:  # the drafts rank 0 accepted were computed too (never a lane's)
            drafts = seq.take_drafts(NO_DRAFTS)
            if seq_ids[cursor] != seq.seq_id:
                cursor = rows.find(seq.seq_id)
            accepted = _num_accepted(result, cursor, drafts)
            new = seq.accepted_drafts(accepted)
            if accepted:
                tokens += drafts[:accepted]
                step += accepted
            verified.append((len(drafts), accepted))
            req = seq.request
            req.num_drafted += len(drafts)
            req.num_accepted += accepted
        if fills is not None and new % block_size < step:  # a block filled up: make it findable
            held = seq.num_kv_tokens
            if new > held:  # report the slots held lazily too
                held = seq.reported_slots(seq.num_reserved_tokens)
            fills.append((seq.seq_id, tokens, held, new))
        if new != len(tokens):
            continue  # mid-prefill or catching up after a recompute: nothing sampled
        if seq.request.pooling is not None:
            pooled.append(seq)  # an embedding request: its prompt is done, nothing sampled
            continue
        if seq_ids[cursor] != seq.seq_id:
            cursor = rows.find(seq.seq_id)
        token = token_ids[cursor]
        cursor += 1
        tokens.append(token)
        req = seq.request
        if (plain and not seq.spec_skip and token not in req.stop_ids
                and new - seq.num_prompt_tokens + 1 < req.max_output_tokens):
            plain_seqs.append(seq)
            plain_tokens.append(token)
        else:
            pending.append((seq, token, cursor - 1))
    if plain_seqs:
        out.seqs = out.seqs + plain_seqs
        out.token_ids = out.token_ids + plain_tokens


def _num_accepted(result: StepResult, row: int, drafts: list[int]) -> int:
    """How many of a sequence's drafts rank 0 accepted (StepResult.num_accepted)."""
    counts = result.num_accepted
    accepted = counts[row] if row < len(counts) else -1
    if not 0 <= accepted <= len(drafts):
        raise ValueError(f"StepResult for step {result.step_id}: sequence "
                         f"{result.seq_ids[row]} had {len(drafts)} drafts but the result "
                         f"accepts {accepted if counts else 'none (no num_accepted)'}")
    return accepted


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
