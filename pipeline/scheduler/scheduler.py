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
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

from pagedserve.pipeline.messages import SharedTables, StepPlan, StepResult
from pagedserve.pipeline.scheduler.decode import PlanBuilder, apply_result, schedule_running
from pagedserve.pipeline.scheduler.admission import RequestRejected, admit_request
from pagedserve.pipeline.scheduler.config import SchedulerConfig
from pagedserve.pipeline.scheduler.emit import emit
from pagedserve.pipeline.scheduler.policy import make_policy
from pagedserve.pipeline.scheduler.preemption import (PreemptionChooser, preempt_for_waiting,
                                           reserve_or_preempt)
from pagedserve.pipeline.sequence import (FINISH_REASONS, STATUS_FOR_REASON, Request, RequestState,
                               Sequence, SequenceOutput, SequenceStatus, StepOutputs)

RUNNING = SequenceStatus.RUNNING
WAITING = SequenceStatus.WAITING
SWAPPED = SequenceStatus.SWAPPED
FINISHED_STOPPED = SequenceStatus.FINISHED_STOPPED
FINISHED_LENGTH = SequenceStatus.FINISHED_LENGTH
FINISHED_ABORTED = SequenceStatus.FINISHED_ABORTED


@dataclass(slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    kv_usage: float
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int  # tokens found
    num_preemptions: int
    prompt_tokens: int  # prompt tokens of admitted requests, cumulative
    generation_tokens: int  # sampled tokens, cumulative
    iteration_tokens: int  # tokens computed in the last step


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache, eos_token_ids=()) -> None:
        if kv_cache.block_size != config.block_size:
            raise ValueError(f"block_size mismatch: scheduler config has {config.block_size}, "
                             f"the KV cache manager {kv_cache.block_size}")
        self.config = config
        self.kv = kv_cache
        self.eos_token_ids = frozenset(eos_token_ids)
        # Every stop id any request has had: a step none of whose tokens is here stops nothing.
        self.stop_id_union: set[int] = set(self.eos_token_ids)
        self.policy = make_policy(config.policy)
        self.preemption = PreemptionChooser(config.preemption_mode, config.swap_threshold_tokens)
        self.block_size = config.block_size
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
        tables = kv_cache.block_tables  # shared-memory rows the workers may read instead
        self._shared_tables = None if tables is None else SharedTables(
            tables.name, tables.max_num_seqs, tables.max_blocks_per_seq)

    @classmethod
    def from_config(cls, config: SchedulerConfig, num_gpu_blocks: int, num_cpu_blocks: int = 0,
                    eos_token_ids=(), block_tables=None) -> "Scheduler":
        """A scheduler over a fresh KVCacheManager built from the same settings."""
        from pagedserve.kvmanager import KVCacheManager
        kv = KVCacheManager(num_gpu_blocks, config.block_size, num_cpu_blocks,
                            enable_prefix_caching=config.enable_prefix_caching,
                            watermark=config.watermark, block_tables=block_tables)
        return cls(config, kv, eos_token_ids)

    # ------------------------------------------------------------------ requests in and out

    def add(self, request: Request) -> None:
        """Queue a request; raises RequestRejected (QueueFull when the queue is at its bound)."""
        if request.request_id in self.requests:
            raise RequestRejected(request.request_id, "a request with this id is already in flight")
        state = admit_request(request, self.config, num_gpu_blocks=self.kv.num_gpu_blocks,
                              num_watermark_blocks=self.num_watermark_blocks,
                              eos_token_ids=self.eos_token_ids,
                              num_queued=self.num_queued_requests)
        seq = self._new_seq(state, 0, list(request.prompt_token_ids) + list(request.output_token_ids))
        self.requests[state.request_id] = state
        if not state.stop_ids <= self.stop_id_union:
            self.stop_id_union |= state.stop_ids
        self.num_queued_requests += 1
        self._push_waiting(seq)

    def abort(self, request_id: str) -> list[SequenceOutput]:
        """Finish every sample of a request with reason 'abort'; unknown ids are ignored (the
        request may have finished while the abort was on its way)."""
        return self._finish_request(request_id, FINISHED_ABORTED, None)

    def stop(self, request_id: str, reason: str = "stop", index: int | None = None
             ) -> list[SequenceOutput]:
        """A stop string was found by the detokenizer: finish sample `index` (None: all)."""
        if reason not in STATUS_FOR_REASON:
            raise ValueError(f"finish reason must be one of {', '.join(STATUS_FOR_REASON)}, "
                             f"got {reason!r}")
        return self._finish_request(request_id, STATUS_FOR_REASON[reason], index)

    def reset_device_state(self) -> int:
        """The workers lost their KV cache: recompute every live sequence (see recovery.py)."""
        from pagedserve.pipeline.scheduler.recovery import requeue_for_recompute
        return requeue_for_recompute(self)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def stats(self) -> SchedulerStats:
        kv = self.kv.stats()
        return SchedulerStats(
            num_running=self.num_running, num_waiting=self.num_waiting,
            num_swapped=self.num_swapped, kv_usage=self.kv.usage,
            prefix_cache_queries=kv.prefix_queries, prefix_cache_hits=kv.prefix_hits,
            num_preemptions=self.num_preemptions, prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens, iteration_tokens=self.iteration_tokens)

    # ------------------------------------------------------------------ the step

    def schedule(self, now: float) -> StepPlan:
        if self._inflight is not None:
            raise RuntimeError(f"schedule() called again before update() for step "
                               f"{self._inflight.step_id}")
        self.kv.hold_rows(False)  # the last plan's step is over: rows freed since are reusable
        b = PlanBuilder(self._next_step_id, self.config.max_num_batched_tokens)
        self._next_step_id += 1
        if self.policy.preempts_for_waiting and self.waiting and self.num_running:
            preempt_for_waiting(self, b)
        new_running = self._spare_running  # empty
        new_prefilling: list[Sequence] = []
        schedule_running(self, b, new_running)
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
        return StepPlan(b.step_id, b.new_seqs, b.scheduled, b.swap_out, b.swap_in, b.copy,
                        b.forks, finished, self._shared_tables, b.lane_ids, b.lane_tokens,
                        b.lane_blocks)

    def _schedule_one_running(self, seq: Sequence, b: PlanBuilder, keep) -> None:
        """The general path for a running sequence: may preempt, resend or compute several."""
        num_new = min(len(seq.token_ids) - seq.num_computed_tokens, b.budget)
        if num_new > 0 and reserve_or_preempt(self, seq, num_new, b):
            emit(self, seq, num_new, b)
        if seq.status is RUNNING:
            keep(seq)

    def _schedule_prefilling(self, b: PlanBuilder, new_running: list[Sequence],
                             new_prefilling: list[Sequence]) -> None:
        for seq in self.prefilling:
            if seq.status is not RUNNING:
                continue
            remaining = len(seq.token_ids) - seq.num_computed_tokens
            chunk = min(remaining, b.budget)
            if chunk and (chunk == remaining or self.config.enable_chunked_prefill) \
                    and reserve_or_preempt(self, seq, chunk, b):
                emit(self, seq, chunk, b)
                (new_running if chunk == remaining else new_prefilling).append(seq)
            elif seq.status is RUNNING:
                new_prefilling.append(seq)

    def _schedule_swapped(self, b: PlanBuilder, new_running: list[Sequence],
                          new_prefilling: list[Sequence]) -> None:
        kv = self.kv
        max_num_seqs = self.config.max_num_seqs
        while (self.swapped and b.budget
               and self.num_running + self.num_unforked < max_num_seqs):
            seq = self.swapped[0][1]
            if seq.status is not SWAPPED:
                heapq.heappop(self.swapped)
                continue
            if self._num_slots(seq) > max_num_seqs - self.num_running - self.num_unforked:
                break  # a parent swapped out before its samples forked
            remaining = len(seq.token_ids) - seq.num_computed_tokens
            chunk = min(remaining, b.budget)
            if not self.config.enable_chunked_prefill and chunk < remaining:
                chunk = 0
            if not self._can_swap_in(seq, chunk):
                break
            heapq.heappop(self.swapped)
            b.swap_in.extend(kv.swap_in(seq.seq_id))
            self.num_swapped -= 1
            self._add_running(seq)
            seq.needs_full_send = True  # its block ids changed
            # Fresh slots beyond the swapped-in table come without preempting anyone now: a
            # sequence swapped in and out in one step would undo itself.
            if chunk and self._grow(seq, chunk, b):
                emit(self, seq, chunk, b)
            (new_running if chunk == remaining else new_prefilling).append(seq)

    def _can_swap_in(self, seq: Sequence, chunk: int) -> bool:
        """Room above the watermark for its blocks and for the ones its next chunk adds, so a
        swapped-in sequence can run at once instead of being pushed straight back out."""
        kv, bs = self.kv, self.block_size
        if not kv.can_swap_in(seq.seq_id):
            return False
        held = -(-seq.num_reserved_tokens // bs)
        grow = max(0, -(-(seq.num_computed_tokens + chunk) // bs) - held)
        return kv.num_free_blocks - held - grow >= self.num_watermark_blocks

    def _schedule_waiting(self, b: PlanBuilder, new_running: list[Sequence],
                          new_prefilling: list[Sequence]) -> None:
        max_num_seqs = self.config.max_num_seqs
        while self.waiting and b.budget and self.num_running + self.num_unforked < max_num_seqs:
            seq = self.waiting[0][1]
            if seq.status is not WAITING:
                heapq.heappop(self.waiting)
                continue
            if seq.preempted_step == b.step_id:
                break  # pushed out this very step: admitting it back would thrash
            if self._num_slots(seq) > max_num_seqs - self.num_running - self.num_unforked:
                break  # its samples will fork into sequences of their own
            done = self._admit(seq, b)
            if done is None:
                break  # head-of-line blocking keeps the order fair (no starvation)
            heapq.heappop(self.waiting)
            (new_running if done else new_prefilling).append(seq)

    def _admit(self, seq: Sequence, b: PlanBuilder) -> bool | None:
        """Allocate and schedule a waiting sequence's first chunk. None: it does not fit now;
        else whether the chunk completes its tokens."""
        kv, req, tokens = self.kv, seq.request, seq.token_ids
        total = len(tokens)
        cached = (kv.lookup_prefix(tokens, req.cache_salt)
                  if self.config.enable_prefix_caching else 0)
        chunk = total - cached
        if chunk > b.budget:
            if not self.config.enable_chunked_prefill:
                return None
            chunk = b.budget
        if not kv.can_allocate(chunk, num_cached_tokens=cached):
            return None  # the watermark keeps room for running sequences to grow
        got = kv.allocate(seq.seq_id, tokens, chunk, req.cache_salt)
        if got is None:
            return None
        seq.num_computed_tokens = got
        seq.num_reserved_tokens = seq.num_kv_tokens = got + chunk
        chunk = min(chunk, total - got)
        self.num_waiting -= 1
        self._add_running(seq)
        if req.queued:
            req.queued = False
            self.num_queued_requests -= 1
            self.prompt_tokens += req.num_prompt_tokens
        emit(self, seq, chunk, b)
        return got + chunk == total

    # ------------------------------------------------------------------ blocks

    def _grow(self, seq: Sequence, num_new: int, b: PlanBuilder) -> bool:
        """Hold slots up to num_computed + num_new; False (nothing changed) if blocks are short."""
        needed = seq.num_computed_tokens + num_new
        if needed <= seq.num_reserved_tokens:
            return True
        bs = self.block_size
        if not seq.shared_tail and needed <= -(-seq.num_kv_tokens // bs) * bs:
            seq.num_reserved_tokens = needed  # inside its own last block: reported lazily
            return True
        cow = self.kv.append_slots(seq.seq_id, needed - seq.num_kv_tokens)
        if cow is None:
            return False
        self._grew(seq, needed, cow, b)
        return True

    @staticmethod
    def _grew(seq: Sequence, needed: int, cow: list[tuple[int, int]], b: PlanBuilder) -> None:
        seq.num_reserved_tokens = seq.num_kv_tokens = needed
        seq.shared_tail = False
        if cow:
            b.copy.extend(cow)
            seq.needs_full_send = True  # a block in its table was replaced

    def _sync_kv(self, seq: Sequence) -> None:
        """Report lazily held slots to the manager (they never need a block or a copy)."""
        lag = seq.num_reserved_tokens - seq.num_kv_tokens
        if lag:
            cow = self.kv.append_slots(seq.seq_id, lag)
            if cow is None or cow:
                raise RuntimeError(f"seq {seq.seq_id}: lazily held slots needed a block or a "
                                   f"copy ({cow}); the slot bookkeeping is wrong")
            seq.num_kv_tokens = seq.num_reserved_tokens

    # ------------------------------------------------------------------ results

    def update(self, plan: StepPlan, result: StepResult, now: float) -> StepOutputs:
        """Apply the workers' sampled tokens; returns what each sample of each request gained."""
        b = self._inflight
        if b is None or plan.step_id != b.step_id:
            raise RuntimeError(f"update() for step {plan.step_id} but the plan in flight is "
                               f"{None if b is None else b.step_id}")
        if result.step_id != plan.step_id:
            raise ValueError(f"StepResult is for step {result.step_id}, the plan is {plan.step_id}")
        self._inflight = None
        outputs = apply_result(self, b, result)
        self.generation_tokens += len(outputs)
        # Forked children decode from the next step on, after their parent.
        self.running.extend(c for c in b.fork_children if c.status is RUNNING)
        return outputs

    def _finish_sampled(self, seq: Sequence, token: int, row: int, result: StepResult
                        ) -> SequenceOutput:
        """The output for a freshly appended token, applying the stop rules."""
        req = seq.request
        num_out = len(seq.token_ids) - seq.num_prompt_tokens
        status = None
        if token in req.stop_ids and num_out >= req.min_tokens:
            status = FINISHED_STOPPED
        elif num_out >= req.max_output_tokens:
            status = FINISHED_LENGTH
        request_finished = status is not None and self._finish(seq, status)
        lp = None if result.logprobs is None else [result.logprobs[row]]
        tlp = None if result.top_logprobs is None else [result.top_logprobs[row]]
        return SequenceOutput(req.request_id, seq.index, [token], FINISH_REASONS.get(status),
                              request_finished, lp, tlp, num_out - 1)

    # ------------------------------------------------------------------ bookkeeping

    @staticmethod
    def _num_slots(seq: Sequence) -> int:
        """Sequences it counts for under max_num_seqs: a parent whose samples have not forked
        yet holds room for them all."""
        req = seq.request
        return 1 if req.forked else req.sampling.n

    def _add_running(self, seq: Sequence) -> None:
        seq.status = RUNNING
        self.num_running += 1
        self.num_unforked += self._num_slots(seq) - 1

    def _remove_running(self, seq: Sequence) -> None:
        """Before `seq` leaves RUNNING (preempted or finished)."""
        self.num_running -= 1
        self.num_unforked -= self._num_slots(seq) - 1

    def _new_seq(self, req: RequestState, index: int, token_ids: list[int]) -> Sequence:
        seq = Sequence(self._next_seq_id, req, index, token_ids)
        self._next_seq_id += 1
        self.seqs[seq.seq_id] = seq
        req.seqs.append(seq)
        return seq

    def _push_waiting(self, seq: Sequence) -> None:
        seq.status = WAITING
        self.num_waiting += 1
        heapq.heappush(self.waiting, (self.policy.key(seq), seq))

    def _finish(self, seq: Sequence, status: SequenceStatus) -> bool:
        """Release a sequence; returns whether that finished its whole request."""
        seq.lane_cap = -1
        inflight = self._inflight
        if inflight is not None and seq.last_step == inflight.step_id:
            inflight.num_finished += 1  # its row is no longer wanted: update goes one by one
        if seq.status is RUNNING:
            self._remove_running(seq)
            self.kv.free(seq.seq_id)
        elif seq.status is SWAPPED:
            self.num_swapped -= 1
            self.kv.free(seq.seq_id)
        elif seq.status is WAITING:
            self.num_waiting -= 1
        seq.status = status
        del self.seqs[seq.seq_id]
        if seq.num_tokens_sent:
            self._finished_seq_ids.append(seq.seq_id)
        req = seq.request
        req.num_unfinished -= 1
        if not req.forked:
            req.num_unfinished = 0  # its siblings will never be forked
        if req.num_unfinished:
            return False
        if req.queued:
            self.num_queued_requests -= 1
        del self.requests[req.request_id]
        return True

    def _finish_request(self, request_id: str, status: SequenceStatus, index: int | None
                        ) -> list[SequenceOutput]:
        req = self.requests.get(request_id)
        if req is None:
            return []
        outputs = []
        for seq in list(req.seqs):
            if seq.status >= FINISHED_STOPPED or (index is not None and seq.index != index):
                continue
            done = self._finish(seq, status)
            outputs.append(SequenceOutput(request_id, seq.index, [], FINISH_REASONS[status], done,
                                          offset=len(seq.token_ids) - seq.num_prompt_tokens))
        return outputs
