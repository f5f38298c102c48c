"""The scheduling policy: which sequences compute how many tokens each step. No I/O, no clock.

One cycle is ``plan = schedule(now)`` -> workers execute it -> ``update(plan, result, now)``.
Each step, in this order:
  0. under a policy that allows it, a waiting request short of blocks preempts lower ones;
  1. running sequences decode, one token each (a sequence that cannot get its next block
     preempts victims - largest policy key first - or is itself preempted);
  2. sequences part-way through their prompt take the next chunk of the remaining budget;
  3. swapped sequences come back (not in a step that swapped some out);
  4. waiting sequences are admitted in policy order while the sequence cap, the token budget and
     free blocks (above the watermark) allow; prefix-cache hits are not recomputed.

The Scheduler owns its state: the queues, the requests and their sequences, the counters. Its
helpers receive narrow collaborators and return decisions - `admission` (checks a request),
`policy` (orders), `preemption` (swap or recompute, which victim), `slots` (a sequence's
KV slots against the KV manager's), `plan` (the plan's encoding), `results` (reads a result
back into the planned sequences) - and never see the Scheduler.

This module holds the Scheduler's state (`__init__`) and the planning of a step (`schedule` and
what it calls). The rest of the request lifecycle - `add`, `abort`, `stop`, `update`,
`reset_device_state`, `stats`, forks, preemptions and finishes - is its base class
`RequestLifecycle` (bookkeeping.py), where `Recovery` and `SchedulerStats` live (re-exported here).
"""
from __future__ import annotations

import heapq
from operator import attrgetter

from pagedserve.pipeline.messages import NewSeq, ScheduledSeq, SharedTables, StepPlan
from pagedserve.pipeline.scheduler.config import SchedulerConfig
from pagedserve.pipeline.scheduler.bookkeeping import Recovery, RequestLifecycle, SchedulerStats
from pagedserve.pipeline.scheduler.lookahead import build_ahead, lanes_ahead
from pagedserve.pipeline.scheduler.plan import NO_BLOCKS, PlanBuilder, lane_cap
from pagedserve.pipeline.scheduler.policy import make_policy
from pagedserve.pipeline.scheduler.preemption import PreemptionChooser, pick_victim
from pagedserve.pipeline.scheduler.quarantine import Quarantine
from pagedserve.pipeline.scheduler.slots import can_swap_in, grow
from pagedserve.pipeline.scheduler.speculative import NgramProposer
from pagedserve.pipeline.scheduler.sequence import RequestState, Sequence, SequenceStatus

__all__ = ["Recovery", "Scheduler", "SchedulerStats"]

SEQ_ID = attrgetter("seq_id")
RUNNING = SequenceStatus.RUNNING
WAITING = SequenceStatus.WAITING
SWAPPED = SequenceStatus.SWAPPED


class Scheduler(RequestLifecycle):
    def __init__(self, config: SchedulerConfig, kv_cache, eos_token_ids=()) -> None:
        if kv_cache.block_size != config.block_size:
            raise ValueError(f"block_size mismatch: scheduler config has {config.block_size}, "
                             f"the KV cache manager {kv_cache.block_size}")
        if getattr(kv_cache, "sliding_window", 0) != config.sliding_window:
            raise ValueError(f"sliding_window mismatch: scheduler config has "
                             f"{config.sliding_window}, the KV cache manager "
                             f"{getattr(kv_cache, 'sliding_window', 0)}")
        self.config = config
        self.kv = kv_cache
        self.eos_token_ids = frozenset(eos_token_ids)
        # Every stop id any request has had: a step none of whose tokens is here stops nothing.
        self.stop_id_union: set[int] = set(self.eos_token_ids)
        self.policy = make_policy(config.policy)
        self.preemption = PreemptionChooser(config.preemption_mode, config.swap_threshold_tokens)
        self.block_size = config.block_size
        # Every layer attends only this many positions back: blocks that slid out of it are
        # released before each step that no longer reads them (kvmanager/window.py).
        self.sliding_window = config.sliding_window
        self.num_watermark_blocks = getattr(kv_cache, "watermark_blocks",
                                            int(config.watermark * kv_cache.num_gpu_blocks))
        self.requests: dict[str, RequestState] = {}
        self.seqs: dict[int, Sequence] = {}  # live (unfinished) sequences
        self.waiting: list[tuple[tuple, Sequence]] = []  # heap by policy key; aborted stay lazily
        self.swapped: list[tuple[tuple, Sequence]] = []  # heap by policy key
        self.running: list[Sequence] = []  # decoding; finished ones dropped at the next step
        # The running list of the next step is built in the one of the step before: a list
        # that lives on is not traversed again by every young-generation garbage collection.
        self._spare_running: list[Sequence] = []
        self.prefilling: list[Sequence] = []  # admitted, prompt (or recompute) not done yet
        self.num_running = self.num_waiting = self.num_swapped = 0  # live sequences
        # Samples that running parents fork once their prompt is done: their room under
        # max_num_seqs is held from the parent's admission on.
        self.num_unforked = 0
        self.num_queued_requests = 0  # never admitted yet: bounded by max_queued_requests
        self.num_preemptions = self.prompt_tokens = self.generation_tokens = 0
        self.iteration_tokens = 0
        self._next_seq_id = 0
        self._next_step_id = 0
        self._finished_seq_ids: list[int] = []  # the workers still hold state for these
        self._inflight: PlanBuilder | None = None
        self._ahead: PlanBuilder | None = None  # planned while _inflight runs (lookahead.py)
        self.num_steps_ahead = 0  # steps planned that way, cumulative
        # Requests that were in a step that crashed the workers wait their turn (quarantine.py).
        self.quarantine = Quarantine()
        # Requests finished since the service last took them (take_finished): it keeps their
        # outputs a while, for a detokenizer that died before delivering them.
        self._finished_requests: list[RequestState] = []
        tables = kv_cache.block_tables  # shared-memory rows the workers may read instead
        self._shared_tables = None if tables is None else SharedTables(
            tables.name, tables.max_num_seqs, tables.max_blocks_per_seq)
        # Structured output's matchers (pipeline/structured/matchers.py); None: not enabled.
        self.grammar_book = None
        # N-gram speculation (speculative.py); None: off.
        spec = config.speculative
        self.proposer = NgramProposer(spec) if spec is not None else None
        self.spec_num_drafts = self.spec_draft_tokens = self.spec_accepted_tokens = 0
        self.spec_accepted_per_pos = [0] * (spec.num_speculative_tokens if spec else 0)

    @classmethod
    def from_config(cls, config: SchedulerConfig, num_gpu_blocks: int, num_cpu_blocks: int = 0,
                    eos_token_ids=(), block_tables=None) -> "Scheduler":
        """A scheduler over a fresh KVCacheManager built from the same settings."""
        from pagedserve.kvmanager import KVCacheManager
        kv = KVCacheManager(num_gpu_blocks, config.block_size, num_cpu_blocks,
                            enable_prefix_caching=config.enable_prefix_caching,
                            watermark=config.watermark, block_tables=block_tables,
                            sliding_window=config.sliding_window)
        return cls(config, kv, eos_token_ids)

    # ------------------------------------------------------------------ the step

    def schedule(self, now: float) -> StepPlan:
        if self._inflight is not None:
            raise RuntimeError(f"schedule() called again before update() for step "
                               f"{self._inflight.step_id}")
        self.kv.hold_rows(False)  # the last plan's step is over: rows freed since are reusable
        b = PlanBuilder(self._next_step_id, self.config.max_num_batched_tokens)
        self._next_step_id += 1
        if self.policy.preempts_for_waiting and self.waiting and self.num_running:
            self._preempt_for_waiting(b)
        new_running = self._spare_running  # empty
        new_prefilling: list[Sequence] = []
        self._schedule_running(b, new_running)
        self._schedule_prefilling(b, new_running, new_prefilling)
        if self.swapped and not b.swap_out:
            self._schedule_swapped(b, new_running, new_prefilling)
        if self.waiting:
            self._schedule_waiting(b, new_running, new_prefilling)
        old_running = self.running
        self.running, self.prefilling = new_running, new_prefilling
        old_running.clear()
        self._spare_running = old_running
        self.iteration_tokens = self.config.max_num_batched_tokens - b.budget
        finished, self._finished_seq_ids = self._finished_seq_ids, []
        self._inflight = b
        self.kv.hold_rows(True)   # workers read this plan's rows until its result is back
        plan = b.build(finished, self._shared_tables)
        if self.grammar_book is not None and self.grammar_book.grammars:
            plan.grammar = self.grammar_book.masks(self.requests, b.step_id, RUNNING)
        return plan

    @property
    def step_in_flight(self) -> StepPlan | None:
        """The plan whose result `update` takes next (None: no step is with the workers)."""
        return None if self._inflight is None else self._inflight.plan

    @property
    def step_ahead(self) -> StepPlan | None:
        """The plan sent behind the step in flight (lookahead.py), if any."""
        return None if self._ahead is None else self._ahead.plan

    def schedule_ahead(self) -> StepPlan | None:
        """The next step planned before the result of the one in flight is back, when it can
        only be the same decodes one token on (lookahead.py); None otherwise. Nothing is
        planned ahead of a queued, swapped out or constrained sequence."""
        b = self._inflight
        if (b is None or self._ahead is not None or not self.config.decode_lanes
                or self.num_waiting or self.num_swapped
                or (self.grammar_book is not None and self.grammar_book.grammars)):
            return None
        found = lanes_ahead(b, self.running, self.num_running, self.kv,
                            block_size=self.block_size, sliding_window=self.sliding_window,
                            max_tokens=self.config.max_num_batched_tokens)
        if found is None:
            return None
        lanes, opening = found
        a = PlanBuilder(self._next_step_id, self.config.max_num_batched_tokens - len(lanes))
        self._next_step_id += 1
        build_ahead(a, lanes, opening, self.kv)
        finished, self._finished_seq_ids = self._finished_seq_ids, []
        self._ahead = a
        self.num_steps_ahead += 1
        plan = a.build(finished, self._shared_tables)
        plan.ahead = True
        return plan

    def _schedule_running(self, b: PlanBuilder, new_running: list[Sequence]) -> None:
        """One token for every decoding sequence, in running order; fills `new_running` (the
        running list from this step on). A sequence at or under its lane_cap is a lane: its
        transition (`Sequence.plan_lane`) puts it in the decode columns, its token counted as computed at once
        (nothing reads the count before the result is back, and a lost step recomputes
        everything). Every other sequence is planned by `_schedule_off_lane` at the same point
        in the order, so plans are what the general path gives."""
        keep = new_running.append
        lanes = b.lanes
        add_lane, add_lane_token = lanes.append, b.lane_tokens.append
        add_fill = b.lane_fills.append
        bs, step_id = self.block_size, b.step_id
        caching = self.config.enable_prefix_caching
        budget = b.budget
        for seq in self.running:
            tokens = seq.token_ids
            n = len(tokens)
            if n > seq.lane_cap or budget <= 0:  # not a lane (a finished or preempted one's is -1)
                b.budget = budget
                is_lane = self._schedule_off_lane(seq, b, keep)
                budget = b.budget
                if not is_lane:
                    continue
            add_lane(seq)
            add_lane_token(tokens[-1])
            seq.plan_lane(step_id, n)
            if caching and not n % bs:
                add_fill(seq)
            budget -= 1
            keep(seq)
        b.budget = budget
        b.lane_ids = list(map(SEQ_ID, lanes))

    def _schedule_off_lane(self, seq: Sequence, b: PlanBuilder, keep) -> bool:
        """A running sequence past its lane_cap (or with no budget left): skipped if it finished
        or was preempted meanwhile, else planned here. True when it is a lane after all, for
        the caller to add to the decode columns.

        A decode whose slot needs a new block takes it from `reserve_slots` (a shared last block
        or a short pool fails that) and is a lane too, its block in decode_new_blocks, unless
        the token it samples may end it by length. Anything else (no budget, a recompute
        catching up, a resend, a copy-on-write, preemptions) takes the general path."""
        if seq.status is not RUNNING:
            return False  # finished or preempted since
        if self.sliding_window:  # its lane_cap ends where its next block slides out
            self.kv.slide_window(seq.seq_id, seq.num_computed_tokens)
        if seq.request.speculates and self._schedule_drafts(seq, b):
            keep(seq)
            return False
        n = len(seq.token_ids)
        if (not self.config.decode_lanes or seq.num_computed_tokens + 1 != n
                or seq.num_reserved_tokens >= n or seq.needs_full_send or b.budget <= 0):
            self._schedule_general(seq, b, keep)
            return False
        bs = self.block_size
        if n <= seq.num_blocks_sent * bs and not seq.shared_tail:
            new_blocks = NO_BLOCKS  # inside the blocks the workers hold: tell the manager later
            seq.hold_slots(n, reported=False)
        else:
            new_blocks = self.kv.reserve_slots(seq.seq_id, n)
            if new_blocks is None:  # its last block is shared, or the pool is short
                self._schedule_general(seq, b, keep)
                return False
            seq.hold_slots(n, reported=True)
            seq.sent_blocks_upto(seq.num_blocks_sent + len(new_blocks))
        if not (new_blocks and seq.num_tokens_sent + 1 == n
                and n <= seq.num_prompt_tokens + seq.request.max_output_tokens - 2):
            self._plan_tokens(seq, 1, new_blocks, b)
            keep(seq)
            return False
        seq.sent_tokens_upto(n)  # a lane that opens a new block: on with the lanes
        b.add_lane_blocks(new_blocks)
        seq.lanes_until(self._lane_cap(seq))
        return True

    def _schedule_drafts(self, seq: Sequence, b: PlanBuilder) -> bool:
        """A steady decode of a speculating request: its last token and up to k drafts from
        its own context, in one forward. False (nothing planned) when nothing recurs, the
        budget or max_tokens leave no room, or the pool is short for the drafts' slots: it
        decodes one token as usual, which may preempt; drafts never do."""
        tokens, spec = seq.token_ids, self.config.speculative
        n = len(tokens)
        if (seq.num_computed_tokens + 1 != n or seq.needs_full_send
                or 0 < spec.disable_by_batch_size < self.num_running):
            return False
        req = seq.request
        k = min(spec.num_speculative_tokens, b.budget - 1,
                req.num_prompt_tokens + req.max_output_tokens - n - 1,
                self.config.max_model_len - n)
        if k <= 0:
            return False
        drafts = self.proposer.propose(seq.seq_id, tokens, k)
        if not drafts or not grow(seq, 1 + len(drafts), self.kv, b.copy):
            return False
        seq.propose(drafts)
        self._emit(seq, 1, b, drafts)
        return True

    def _schedule_general(self, seq: Sequence, b: PlanBuilder, keep) -> None:
        """A running sequence the general way: may preempt, resend or compute several."""
        num_new = min(len(seq.token_ids) - seq.num_computed_tokens, b.budget)
        if num_new > 0 and self._reserve_or_preempt(seq, num_new, b):
            self._emit(seq, num_new, b)
        if seq.status is RUNNING:
            keep(seq)

    def _schedule_prefilling(self, b: PlanBuilder, new_running: list[Sequence],
                             new_prefilling: list[Sequence]) -> None:
        for seq in self.prefilling:
            if seq.status is not RUNNING:
                continue
            if self.sliding_window:
                self.kv.slide_window(seq.seq_id, seq.num_computed_tokens)
            remaining = len(seq.token_ids) - seq.num_computed_tokens
            chunk = min(remaining, b.budget)
            if chunk and (chunk == remaining or self.config.enable_chunked_prefill) \
                    and self._reserve_or_preempt(seq, chunk, b):
                self._emit(seq, chunk, b)
                (new_running if chunk == remaining else new_prefilling).append(seq)
            elif seq.status is RUNNING:
                new_prefilling.append(seq)

    def _schedule_swapped(self, b: PlanBuilder, new_running: list[Sequence],
                          new_prefilling: list[Sequence]) -> None:
        kv = self.kv
        while self.swapped and b.budget and self._room_for(1):
            seq = self.swapped[0][1]
            if seq.status is not SWAPPED:
                heapq.heappop(self.swapped)
                continue
            if not self._room_for(seq.request.num_seq_slots):
                break  # a parent swapped out before its samples forked
            if self.quarantine.suspects and self.quarantine.holds(seq.request):
                break  # another suspect is on trial
            remaining = len(seq.token_ids) - seq.num_computed_tokens
            chunk = min(remaining, b.budget)
            if not self.config.enable_chunked_prefill and chunk < remaining:
                chunk = 0
            if not can_swap_in(seq, chunk, self.kv, self.num_watermark_blocks):
                break
            heapq.heappop(self.swapped)
            self.quarantine.begin_trial(seq.request)
            b.swap_in.extend(kv.swap_in(seq.seq_id, seq.num_computed_tokens))
            self.num_swapped -= 1
            self._add_running(seq)
            seq.table_changed()
            # Fresh slots beyond the swapped-in table come without preempting anyone now: a
            # sequence swapped in and out in one step would undo itself.
            if chunk and grow(seq, chunk, self.kv, b.copy):
                self._emit(seq, chunk, b)
            (new_running if chunk == remaining else new_prefilling).append(seq)

    def _schedule_waiting(self, b: PlanBuilder, new_running: list[Sequence],
                          new_prefilling: list[Sequence]) -> None:
        while self.waiting and b.budget and self._room_for(1):
            seq = self.waiting[0][1]
            if seq.status is not WAITING:
                heapq.heappop(self.waiting)
                continue
            if seq.preempted_step == b.step_id:
                break  # pushed out this very step: admitting it back would thrash
            if not self._room_for(seq.request.num_seq_slots):
                break  # its samples will fork into sequences of their own
            if self.quarantine.suspects and self.quarantine.holds(seq.request):
                break  # another suspect is on trial
            done = self._admit(seq, b)
            if done is None:
                break  # head-of-line blocking keeps the order fair (no starvation)
            heapq.heappop(self.waiting)
            self.quarantine.begin_trial(seq.request)
            (new_running if done else new_prefilling).append(seq)

    def _admit(self, seq: Sequence, b: PlanBuilder) -> bool | None:
        """Allocate and schedule a waiting sequence's first chunk. None: it does not fit now;
        else whether the chunk completes its tokens."""
        kv, req, tokens = self.kv, seq.request, seq.token_ids
        total = len(tokens)
        # A pooling that reads every prompt token's hidden state computes them all in one step
        # (pipeline/pooling.py): no cached prefix, no chunks. A request that still wants its
        # prompt logprobs computes every position too (its blocks are cached all the same).
        whole = req.pooling is not None and self.config.pooling_whole_prompt
        reads_cache = (self.config.enable_prefix_caching and not whole
                       and not req.wants_prompt_logprobs)
        cached = kv.lookup_prefix(tokens, req.cache_salt) if reads_cache else 0
        chunk = total - cached
        if chunk > b.budget:
            if whole or not self.config.enable_chunked_prefill:
                return None
            chunk = b.budget
        if not kv.can_allocate(chunk, num_cached_tokens=cached):
            return None  # the watermark keeps room for running sequences to grow
        got = kv.allocate(seq.seq_id, () if whole else tokens, chunk, req.cache_salt,
                          read_cache=reads_cache)
        if got is None:
            return None
        seq.admitted(got, chunk)
        chunk = min(chunk, total - got)
        self.num_waiting -= 1
        self._add_running(seq)
        if req.queued:
            req.queued = False
            self.num_queued_requests -= 1
            self.prompt_tokens += req.num_prompt_tokens
        self._emit(seq, chunk, b)
        return got + chunk == total

    # ------------------------------------------------------------------ plan entries

    def _emit(self, seq: Sequence, num_tokens: int, b: PlanBuilder,
              drafts: list[int] = NO_BLOCKS) -> None:
        """Plan `seq` computing `num_tokens` (and `drafts` after them), sending only what the
        workers lack."""
        sid, tokens = seq.seq_id, seq.token_ids
        if seq.needs_full_send:
            block_ids = self.kv.block_table(sid)
            npr = seq.num_prompt_tokens
            b.add_full(seq, NewSeq(sid, tokens[:npr], tokens[npr:],
                                   seq.request.sampling.for_sample(seq.index), block_ids,
                                   seq.num_computed_tokens, self.kv.row_of(sid),
                                   seq.request.pooling is not None), num_tokens,
                       drafts)
            seq.sent_in_full(len(block_ids), len(tokens))
            self._planned(seq, num_tokens, b)
            return
        num_blocks = (seq.num_reserved_tokens + self.block_size - 1) // self.block_size
        new_blocks = NO_BLOCKS
        if num_blocks > seq.num_blocks_sent:
            new_blocks = self.kv.block_table(sid)[seq.num_blocks_sent:]
            seq.sent_blocks_upto(num_blocks)
        self._plan_tokens(seq, num_tokens, new_blocks, b, drafts)

    def _plan_tokens(self, seq: Sequence, num_tokens: int, new_blocks: list[int],
                     b: PlanBuilder, drafts: list[int] = NO_BLOCKS) -> None:
        """A ScheduledSeq with the tokens and blocks the workers have not seen yet."""
        tokens, sent = seq.token_ids, seq.num_tokens_sent
        unsent = [tokens[sent]] if sent + 1 == len(tokens) else tokens[sent:]
        if drafts or seq.spec_skip:
            entry = ScheduledSeq(seq.seq_id, num_tokens, new_blocks, unsent, drafts,
                                 seq.take_spec_skip())
        else:
            entry = ScheduledSeq(seq.seq_id, num_tokens, new_blocks, unsent)
        b.add_scheduled(seq, entry)
        seq.sent_tokens_upto(len(tokens))
        self._planned(seq, num_tokens, b)

    def _planned(self, seq: Sequence, num_tokens: int, b: PlanBuilder) -> None:
        if not seq.planned(num_tokens, b.step_id):
            seq.lanes_until(-1)  # mid-prefill: it samples nothing this step
            return
        if not seq.request.forked:
            self._fork_samples(seq, b)
        seq.lanes_until(self._lane_cap(seq) if self.config.decode_lanes else -1)

    def _lane_cap(self, seq: Sequence) -> int:
        """lane_cap, and under a sliding window no further than the step (at
        num_computed_tokens = len(token_ids) - 1) that releases its next block: that one takes
        the general path, which slides the window first."""
        if seq.request.speculates:
            return -1  # its decodes may carry drafts: planned one by one
        cap = lane_cap(seq, self.block_size)
        if self.sliding_window:
            cap = min(cap, self.kv.window_release_at(seq.seq_id))
        return cap

    # ------------------------------------------------------------------ blocks and preemption

    def _reserve_or_preempt(self, seq: Sequence, num_new: int, b: PlanBuilder) -> bool:
        """Make room for `num_new` more tokens of `seq`, preempting others (or `seq` itself,
        returning False) when the pool is short."""
        while not grow(seq, num_new, self.kv, b.copy):
            victim = pick_victim((self.running, self.prefilling), self.policy.key, b.step_id)
            if victim is None:
                raise RuntimeError(f"seq {seq.seq_id} is short of blocks and no sequence is left "
                                   "to preempt, itself included")
            self._preempt(victim, b)
            if victim is seq:
                return False
        return True

    def _preempt_for_waiting(self, b: PlanBuilder) -> None:
        """Let the waiting head push out running sequences it outranks when blocks are short."""
        while self.waiting and self.waiting[0][1].status is not WAITING:
            heapq.heappop(self.waiting)
        if not self.waiting:
            return
        head = self.waiting[0][1]
        tokens = head.token_ids
        cached = (self.kv.lookup_prefix(tokens, head.request.cache_salt)
                  if self.config.enable_prefix_caching
                  and not head.request.wants_prompt_logprobs else 0)
        need = min(len(tokens) - cached, self.config.max_num_batched_tokens)
        while not self.kv.can_allocate(need, num_cached_tokens=cached):
            victim = pick_victim((self.running, self.prefilling), self.policy.key, b.step_id)
            if victim is None or not self.policy.may_preempt(head, victim):
                return
            self._preempt(victim, b)
