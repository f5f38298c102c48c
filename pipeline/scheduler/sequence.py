"""Request and sequence state as the scheduler keeps it (docs/INTERFACES.md, "Requests and
sequences")."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pagedserve.pipeline.messages import PromptLogprobs
from pagedserve.pipeline.lora_request import LoRARequest
from pagedserve.pipeline.pooling import PoolingParams
from pagedserve.pipeline.sampling_params import SamplingParams


class SequenceStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    SWAPPED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5


# The statuses by name, for the modules' hot loops (a global, not an enum attribute, lookup).
WAITING, RUNNING, SWAPPED, FINISHED_STOPPED, FINISHED_LENGTH, FINISHED_ABORTED = SequenceStatus
FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}
STATUS_FOR_REASON = {reason: status for status, reason in FINISH_REASONS.items()}


@dataclass(slots=True)
class Request:
    """What `Scheduler.add` needs; the process wrapper builds it from the AddRequest message."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = 0.0
    priority: int = 0
    cache_salt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)  # a resubmission's (n = 1)
    pooling: PoolingParams | None = None  # an embedding request: prefill-only
    lora: LoRARequest | None = None  # its LoRA adapter; None: the base model


@dataclass(slots=True, eq=False)
class RequestState:
    """Per-request bookkeeping shared by its sequences."""

    request_id: str
    sampling: SamplingParams
    arrival_time: float
    priority: int
    cache_salt: str | None
    num_prompt_tokens: int
    max_output_tokens: int  # counts resubmitted output tokens too
    stop_ids: frozenset[int]  # EOS (unless ignore_eos) and stop_token_ids
    pooling: PoolingParams | None = None  # an embedding request: pooled, never sampled
    lora: LoRARequest | None = None  # sent with each NewSeq; its cache_salt carries it too
    seqs: list[Sequence] = field(init=False, default_factory=list)  # index == sample index
    num_unfinished: int = field(init=False)  # children count before they exist
    forked: bool = field(init=False)  # nothing to fork for a single sample
    queued: bool = field(init=False, default=True)  # counted against max_queued_requests
    crashes: int = field(init=False, default=0)  # steps that crashed the workers since it sampled
    # Its sequences draft tokens (n-gram speculation on, and no penalties, logprobs or
    # grammar); the drafts proposed and accepted, for its acceptance rate.
    speculates: bool = field(init=False, default=False)
    num_drafted: int = field(init=False, default=0)
    num_accepted: int = field(init=False, default=0)
    num_prompt_logprobs: int = field(init=False, default=1)  # passed on (the first has none)

    def __post_init__(self) -> None:
        self.num_unfinished = self.sampling.n
        self.forked = self.sampling.n == 1

    @property
    def wants_prompt_logprobs(self) -> bool:
        """It asked for prompt logprobs and has not had them all: its prompt positions must be
        computed, so it reads nothing from the prefix cache (as vLLM does)."""
        return (self.sampling.prompt_logprobs is not None
                and self.num_prompt_logprobs < self.num_prompt_tokens)

    def take_prompt_logprobs(self, chunk: PromptLogprobs) -> PromptLogprobs | None:
        """The part of a computed chunk that is new and follows what was passed on (a
        recompute repeats positions; a gap, which no schedule makes, passes nothing)."""
        new = chunk.after(self.num_prompt_logprobs)
        if new is None or new.start != self.num_prompt_logprobs:
            return None
        self.num_prompt_logprobs = new.start + len(new.logprobs)
        return new

    @property
    def num_seq_slots(self) -> int:
        """Sequences a running sample counts for under max_num_seqs: a parent whose samples
        have not forked yet holds room for them all."""
        return 1 if self.forked else self.sampling.n


class Sequence:
    """One sample's state. Cheap attribute access matters: thousands are touched every step."""

    __slots__ = ("seq_id", "request", "index", "token_ids", "num_prompt_tokens",
                 "num_computed_tokens", "num_reserved_tokens", "num_kv_tokens", "shared_tail",
                 "status", "num_tokens_sent", "num_blocks_sent", "needs_full_send", "step_tokens",
                 "last_step", "preempted_step", "lane_cap", "drafts", "spec_skip", "embedding")

    def __init__(self, seq_id: int, request: RequestState, index: int, token_ids: list[int]
                 ) -> None:
        self.seq_id = seq_id
        self.request = request
        self.index = index
        self.token_ids = token_ids  # prompt + outputs
        self.num_prompt_tokens = request.num_prompt_tokens
        self.num_computed_tokens = self.num_reserved_tokens = 0  # reserved: KV slots it holds
        # Slots the KV cache manager has been told about. The difference lies inside the
        # sequence's own, unshared last block and is reported lazily (`sync_kv`, before a fork,
        # swap or preemption), which saves a manager call on most decode steps.
        self.num_kv_tokens = 0
        self.shared_tail = False  # its last block may be shared (just forked): no lazy slots
        self.status = SequenceStatus.WAITING
        self.num_tokens_sent = self.num_blocks_sent = 0  # what the workers hold: plans are diffs
        self.needs_full_send = True  # next plan carries a NewSeq for it
        self.step_tokens = 0  # tokens it computes in the plan in flight (outside the lanes)
        self.last_step = -1  # last step that scheduled it
        self.preempted_step = -1  # not re-admitted in the step that pushed it out
        # While len(token_ids) <= lane_cap, its next step is a steady decode that goes in the
        # plan's decode columns (StepRule.lane_cap); -1: take the general path.
        self.lane_cap = -1
        self.drafts: list[int] = []  # tokens proposed after its last one in the step in flight
        # Accepted drafts the workers computed but have not been told of (the next plan's
        # ScheduledSeq.num_skipped).
        self.spec_skip = 0
        self.embedding: bytes | None = None  # a pooling sequence's vector (float32, LE)

    # Every change of a sequence's fields is one of the transitions below: the scheduler's
    # modules decide, the sequence records (tests/pipeline/test_sequence_owner.py checks that
    # no other module assigns them). Tokens are appended to `token_ids` by `update` in place.

    # -- its place in the scheduler's queues (queues.py) --------------------------------------
    def moved_to(self, status: SequenceStatus) -> None:
        """Now in the queue of `status`: WAITING, RUNNING or SWAPPED."""
        self.status = status

    def finished_as(self, status: SequenceStatus) -> None:
        self.status = status
        self.lane_cap = -1

    # -- its KV slots -------------------------------------------------------------------------
    def admitted(self, num_cached: int, chunk: int) -> None:
        """Given blocks with `num_cached` tokens found in the prefix cache and slots for
        `chunk` more, all reported to the manager."""
        self.num_computed_tokens = num_cached
        self.num_reserved_tokens = self.num_kv_tokens = num_cached + chunk

    def hold_slots(self, needed: int, reported: bool) -> None:
        """Holds KV slots up to `needed`. `reported`: the manager knows of them (and its last
        block is its own now); else they lie in its own last block, reported later."""
        self.num_reserved_tokens = needed
        if reported:
            self.num_kv_tokens = needed
            self.shared_tail = False

    def reported_slots(self, upto: int) -> int:
        self.num_kv_tokens = upto
        return upto

    def grow(self, num_new: int, kv, copies: list[tuple[int, int]]) -> bool:
        """Hold slots up to num_computed + num_new; False (nothing changed) if blocks are short.
        A shared partial last block is copied first: the (src, dst) pair goes to `copies`."""
        needed = self.num_computed_tokens + num_new
        if needed <= self.num_reserved_tokens:
            return True
        bs = kv.block_size
        if not self.shared_tail and needed <= -(-self.num_kv_tokens // bs) * bs:
            self.hold_slots(needed, reported=False)  # inside its own last block
            return True
        cow = kv.append_slots(self.seq_id, needed - self.num_kv_tokens)
        if cow is None:
            return False
        self.hold_slots(needed, reported=True)
        if cow:
            copies.extend(cow)
            self.needs_full_send = True  # a block in its table was replaced
        return True

    def reserve_lane(self, kv, n: int) -> list[int] | None:
        """Slots up to `n`, reported; the new blocks, which go with the lane (None: its last
        block is shared or the pool is short)."""
        blocks = kv.reserve_slots(self.seq_id, n)
        if blocks is not None:
            self.hold_slots(n, reported=True)
            self.num_blocks_sent += len(blocks)
        return blocks

    def sync_kv(self, kv) -> None:
        """Report lazily held slots to the manager (they never need a block or a copy)."""
        lag = self.num_reserved_tokens - self.num_kv_tokens
        if lag:
            cow = kv.append_slots(self.seq_id, lag)
            if cow is None or cow:
                raise RuntimeError(f"seq {self.seq_id}: lazily held slots needed a block or a "
                                   f"copy ({cow}); the slot bookkeeping is wrong")
            self.num_kv_tokens = self.num_reserved_tokens

    def share_tail(self) -> None:
        """Its samples were forked from it: its last block is shared until copied on write."""
        self.shared_tail = True

    def table_changed(self) -> None:
        """Its block ids changed (swapped in): the next plan sends its state in full."""
        self.needs_full_send = True

    # -- planning: what the next step computes, and what the workers hold ---------------------
    def plan_lane(self, step_id: int, n: int) -> None:
        """Planned as a lane at its `n` = len(token_ids) tokens: the token counts as computed
        at once (nothing reads the count before the result is back; a lost step recomputes)."""
        self.num_reserved_tokens = self.num_tokens_sent = self.num_computed_tokens = n
        self.last_step = step_id

    def planned(self, num_tokens: int, step_id: int) -> bool:
        """Planned to compute `num_tokens` in step `step_id`; whether that reaches the end of
        its tokens (it samples)."""
        self.step_tokens = num_tokens
        self.last_step = step_id
        return self.num_computed_tokens + num_tokens >= len(self.token_ids)

    def lanes_until(self, cap: int) -> None:
        """Its next steps are lanes while it has at most `cap` tokens (-1: none)."""
        self.lane_cap = cap

    def sent_in_full(self, num_blocks: int, num_tokens: int) -> None:
        """The plan carries its whole state (a NewSeq)."""
        self.needs_full_send = False
        self.spec_skip = 0
        self.num_blocks_sent = num_blocks
        self.num_tokens_sent = num_tokens

    def sent_blocks_upto(self, num_blocks: int) -> None:
        self.num_blocks_sent = num_blocks

    def sent_tokens_upto(self, num_tokens: int) -> None:
        self.num_tokens_sent = num_tokens

    def take_spec_skip(self) -> int:
        skip, self.spec_skip = self.spec_skip, 0
        return skip

    def propose(self, drafts: list[int]) -> None:
        self.drafts = drafts

    # -- results: what a step computed (results.py) -------------------------------------------
    def computed(self, num_tokens: int) -> int:
        self.num_computed_tokens += num_tokens
        return self.num_computed_tokens

    def take_drafts(self, none: list[int]) -> list[int]:
        drafts, self.drafts = self.drafts, none
        return drafts

    def accepted_drafts(self, accepted: int) -> int:
        """The workers accepted its first `accepted` drafts (computed, and told of by the next
        plan); returns the count computed."""
        self.spec_skip = accepted
        self.num_computed_tokens += accepted
        return self.num_computed_tokens

    # -- losing state -------------------------------------------------------------------------
    def drop_kv(self) -> None:
        """Its KV is gone (freed, or lost with the workers): it recomputes from the start."""
        self.num_computed_tokens = self.num_reserved_tokens = self.num_kv_tokens = 0
        self.shared_tail = False

    def preempted(self, step_id: int) -> None:
        """Pushed out in step `step_id`: it comes back with a new block table, sent in full."""
        self.preempted_step = step_id
        self.needs_full_send = True
        self.lane_cap = -1

    def pooled(self, vector: bytes) -> None:
        """Its prompt is computed and pooled into `vector`: it is done (the caller finishes it)."""
        self.embedding = vector
        self.num_computed_tokens = len(self.token_ids)

    def workers_reset(self) -> None:
        """The workers hold nothing for it any more (their group restarted)."""
        self.num_tokens_sent = self.num_blocks_sent = self.step_tokens = self.spec_skip = 0
        self.drafts = []
        self.needs_full_send = True
        self.preempted_step = self.lane_cap = -1

    def fork_from(self, parent: Sequence, step_id: int) -> None:
        """A sample forked from `parent` on the step that completes its prompt: it shares the
        parent's blocks, and the workers copy the parent's state, so nothing is sent for it."""
        self.status = SequenceStatus.RUNNING
        self.num_computed_tokens = parent.num_computed_tokens + parent.step_tokens
        self.num_reserved_tokens = self.num_kv_tokens = parent.num_reserved_tokens
        self.shared_tail = True
        self.needs_full_send = False
        self.num_tokens_sent = parent.num_tokens_sent
        self.num_blocks_sent = parent.num_blocks_sent
        self.last_step = step_id

    # Convenience views; the hot paths use token_ids / num_prompt_tokens directly.
    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status >= SequenceStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def __repr__(self) -> str:
        return (f"Sequence(seq_id={self.seq_id}, request={self.request.request_id!r}, "
                f"status={self.status.name}, tokens={len(self.token_ids)}, "
                f"computed={self.num_computed_tokens})")
