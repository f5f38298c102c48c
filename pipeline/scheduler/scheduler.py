"""The scheduler: which sequences compute how many tokens each step. No I/O, no clock.

One cycle is ``plan = schedule(now)`` -> workers execute it -> ``update(plan, result, now)``.
The Scheduler composes the owners of its state - `SequenceQueues` (queues.py), `RequestLifecycle`
(lifecycle.py), `StepRule` (step_rule.py: what each sequence computes) and the KV manager - and
holds the step in flight and the one planned ahead (`schedule_ahead`: why that is safe is
docs/ARCHITECTURE.md's "Overlapped scheduling").
"""
from __future__ import annotations

from operator import attrgetter

from pagedserve.pipeline.messages import SharedTables, StepPlan, StepResult, TierOps
from pagedserve.pipeline.scheduler.config import SchedulerConfig
from pagedserve.pipeline.scheduler.lifecycle import RequestLifecycle
from pagedserve.pipeline.scheduler.plan import PlanBuilder
from pagedserve.pipeline.scheduler.queues import POLICIES, SequenceQueues
from pagedserve.pipeline.scheduler.results import advance
from pagedserve.pipeline.scheduler.sequence import (FINISHED_ABORTED, RUNNING, STATUS_FOR_REASON,
                                                    Request, RequestState, Sequence)
from pagedserve.pipeline.scheduler.step_rule import StepRule
from pagedserve.pipeline.scheduler.step_outputs import (Recovery, SchedulerStats, SequenceOutput,
                                                        StepOutputs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache, eos_token_ids=()) -> None:
        for name in ("block_size", "sliding_window"):
            if getattr(kv_cache, name, 0) != getattr(config, name):
                raise ValueError(f"{name} mismatch: scheduler config has "
                                 f"{getattr(config, name)}, the KV cache manager "
                                 f"{getattr(kv_cache, name, 0)}")
        self.config = config
        self.kv = kv_cache
        policy = POLICIES[config.policy]()
        tables = kv_cache.block_tables  # shared-memory rows the workers may read instead
        self._shared_tables = None if tables is None else SharedTables(
            tables.name, tables.max_num_seqs, tables.max_blocks_per_seq)
        self.queues = SequenceQueues(policy.key, config.max_num_seqs)
        self.life = RequestLifecycle(config, kv_cache, self.queues, frozenset(eos_token_ids))
        self.rule = StepRule(config, kv_cache, self.queues, self.life, policy)
        self.generation_tokens = self.iteration_tokens = 0
        self._next_step_id = 0
        self._inflight: PlanBuilder | None = None
        self._ahead: PlanBuilder | None = None  # planned while _inflight runs
        self.num_steps_ahead = 0  # steps planned that way, cumulative
        spec = config.speculative
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

    # Read-only views of what the composed owners hold.
    requests = property(lambda self: self.life.requests)
    seqs = property(lambda self: self.life.seqs)
    quarantine = property(lambda self: self.life.quarantine)
    proposer = property(lambda self: self.life.proposer)
    num_preemptions = property(lambda self: self.life.num_preemptions)
    num_running = property(lambda self: self.queues.num_running)
    num_waiting = property(lambda self: self.queues.num_waiting)
    num_swapped = property(lambda self: self.queues.num_swapped)
    num_unforked = property(lambda self: self.queues.num_unforked)

    # Structured output's matchers (pipeline/structured/matchers.py); None: not enabled.
    grammar_book = property(lambda self: self.life.grammar_book,
                            lambda self, book: setattr(self.life, "grammar_book", book))

    def add(self, request: Request) -> None:
        """Queue a request; raises RequestRejected (QueueFull when the queue is at its bound)."""
        self.life.add(request)

    def abort(self, request_id: str) -> list[SequenceOutput]:
        """Finish every sample of a request with reason 'abort'; unknown ids (done) are ignored."""
        return self.life.finish_request(request_id, FINISHED_ABORTED, None, self._inflight)

    def stop(self, request_id: str, reason: str = "stop", index: int | None = None
             ) -> list[SequenceOutput]:
        """A stop string was found by the detokenizer: finish sample `index` (None: all)."""
        if reason not in STATUS_FOR_REASON:
            raise ValueError(f"finish reason must be one of {', '.join(STATUS_FOR_REASON)}, "
                             f"got {reason!r}")
        return self.life.finish_request(request_id, STATUS_FOR_REASON[reason], index,
                                        self._inflight)

    def has_unfinished(self) -> bool:
        return bool(self.life.requests)

    def take_finished(self) -> list[RequestState]:
        """The requests that finished since the last call (their sequences keep their tokens)."""
        return self.life.take_finished()

    def stats(self) -> SchedulerStats:
        kv, q = self.kv.stats(), self.queues
        return SchedulerStats(
            num_running=q.num_running, num_waiting=q.num_waiting, num_swapped=q.num_swapped,
            kv_usage=self.kv.usage, prefix_cache_queries=kv.prefix_queries,
            prefix_cache_hits=kv.prefix_hits, num_preemptions=self.life.num_preemptions,
            prompt_tokens=self.life.prompt_tokens, generation_tokens=self.generation_tokens,
            iteration_tokens=self.iteration_tokens, spec_num_drafts=self.spec_num_drafts,
            spec_draft_tokens=self.spec_draft_tokens,
            spec_accepted_tokens=self.spec_accepted_tokens,
            spec_accepted_per_pos=tuple(self.spec_accepted_per_pos))

    def reset_device_state(self, cause: str = "", attributable: bool = False) -> Recovery:
        """The workers lost their KV cache (a rank died, hung or raised): recompute what lived
        there and what the lost step swapped out (its copies may never have happened); the
        host pool survives. `attributable` and quarantine: docs/INTERFACES.md."""
        kv, lost, life = self.kv, self._inflight, self.life
        unreliable = [cpu for _gpu, cpu in lost.swap_out] if lost is not None else []
        dropped = set(kv.drop_device_pool(unreliable))
        self._inflight = self._ahead = None
        life.take_finished_seq_ids()
        culprits = life.quarantine.record_crash(life.requests_of(lost)) \
            if attributable and lost is not None else []
        swapped, waiting = [], []
        for seq in life.seqs.values():  # the live ones
            seq.workers_reset()
            if seq.seq_id in kv and seq.seq_id not in dropped:  # swapped out, host copy intact
                swapped.append(seq)
            else:
                seq.drop_kv()
                waiting.append(seq)
        self.queues.rebuild(swapped, waiting)
        failed = []
        for req in culprits:
            life.finish_request(req.request_id, FINISHED_ABORTED, None, None)
            failed.append((req.request_id, (
                f"request {req.request_id!r} was in {req.crashes} steps in a row that crashed "
                f"the worker group (last: {cause or 'unknown cause'}); it was failed so that "
                f"the other requests could complete")))
        return Recovery(self.queues.num_waiting, failed)

    def schedule(self, now: float) -> StepPlan:
        if self._inflight is not None:
            raise RuntimeError(f"schedule() called again before update() for step "
                               f"{self._inflight.step_id}")
        self.kv.hold_rows(False)  # the last plan's step is over: rows freed since are reusable
        b = self._new_step(self.config.max_num_batched_tokens)
        self.rule.plan(b)
        self.iteration_tokens = self.config.max_num_batched_tokens - b.budget
        self._inflight = b
        self.kv.hold_rows(True)   # workers read this plan's rows until its result is back
        plan = self._build(b)
        book = self.life.grammar_book
        if book is not None and book.grammars:
            plan.grammar = book.masks(self.life.requests, b.step_id, RUNNING)
        return plan

    def _new_step(self, budget: int) -> PlanBuilder:
        b = PlanBuilder(self._next_step_id, budget)
        self._next_step_id += 1
        if self.kv.tiers is not None:
            self.kv.tiers.begin_step()  # stores picked before the plan's allocations may evict them
        return b

    def _build(self, b: PlanBuilder) -> StepPlan:
        plan = b.build(self.life.take_finished_seq_ids(), self._shared_tables)
        ops = None if self.kv.tiers is None else self.kv.tiers.take_ops()
        if ops is not None:
            plan.tiers = TierOps(*ops)
        return plan

    @property
    def step_in_flight(self) -> StepPlan | None:
        """The plan whose result `update` takes next (None: no step is with the workers)."""
        return None if self._inflight is None else self._inflight.plan

    def schedule_ahead(self) -> StepPlan | None:
        """The next step, planned before the result of the one in flight is back when it can only
        be the same lanes one token on (ARCHITECTURE.md, "Overlapped scheduling"); else None."""
        b, q, book = self._inflight, self.queues, self.life.grammar_book
        if (b is None or self._ahead is not None or not self.config.decode_lanes
                or q.num_waiting or q.num_swapped or (book is not None and book.grammars)
                or b.seqs or b.fork_children or b.swap_out or b.swap_in or b.copy):
            return None
        lanes = [seq for seq in q.running if seq.status is RUNNING]
        if not lanes or len(lanes) != q.num_running:
            return None  # a live sequence outside the running list (prefilling): plan it
        opening = []  # the lanes whose token ahead opens a block
        for index, seq in enumerate(lanes):
            # in the step in flight as a lane, and a lane again with the token it is sampling
            if seq.last_step != b.step_id:
                return None
            if len(seq.token_ids) + 1 > seq.lane_cap:
                if self.config.sliding_window or not _opens_a_block(seq, self.config.block_size):
                    return None
                opening.append(index)
        budget = self.config.max_num_batched_tokens
        if budget < len(lanes) or len(opening) > self.kv.num_free_blocks:
            return None
        a = self._new_step(budget - len(lanes))
        a.lanes, a.lane_ids, a.lane_tokens = lanes, [seq.seq_id for seq in lanes], [-1] * len(lanes)
        for index in opening:
            seq = lanes[index]
            blocks = seq.reserve_lane(self.kv, len(seq.token_ids) + 1)
            if not blocks:  # counted free, not shared: the slot bookkeeping is wrong
                raise RuntimeError(f"seq {seq.seq_id}: no block for its token ahead ({blocks})")
            a.lane_blocks.extend((index, block) for block in blocks)
        self._ahead = a
        self.num_steps_ahead += 1
        plan = self._build(a)
        plan.ahead = True
        return plan

    def update(self, plan: StepPlan, result: StepResult, now: float) -> StepOutputs:
        """Apply the workers' sampled tokens; returns what each sample of each request gained."""
        b = self._inflight
        if b is None or plan.step_id != b.step_id:
            raise RuntimeError(f"update() for step {plan.step_id} but the plan in flight is "
                               f"{None if b is None else b.step_id}")
        if result.step_id != plan.step_id:
            raise ValueError(f"StepResult is for step {result.step_id}, the plan is {plan.step_id}")
        self._inflight = None
        if result.tier_failed and self.kv.tiers is not None:
            self.kv.tiers.on_failed(result.tier_failed)
        life = self.life
        outputs, pending, pooled = advance(b, result, self.kv, block_size=self.config.block_size,
                                           caching=self.config.enable_prefix_caching,
                                           stop_id_union=life.stop_id_union)
        if result.prompt_logprobs:  # before the stop rules finish (and forget) sequences
            outputs.prompt_logprobs = life.new_prompt_logprobs(result)
        if pooled:  # finished in sequence order, as the stop rules below
            pooled.sort(key=attrgetter("seq_id"))
            outputs.others.extend(life.finish_pooled(pooled, result))
        if pending:  # stop rules in sequence order, whatever the encoding (INTERFACES.md)
            pending.sort(key=lambda sampled: sampled[0].seq_id)
            outputs.others.extend(life.finish_sampled(seq, row, result)
                                  for seq, _token, row in pending)
        self.generation_tokens += len(outputs.seqs) + sum(len(o.new_token_ids)
                                                          for o in outputs.others)
        for drafted, accepted in b.verified:
            self.spec_num_drafts += 1
            self.spec_draft_tokens += drafted
            self.spec_accepted_tokens += accepted
            for pos in range(accepted):
                self.spec_accepted_per_pos[pos] += 1
        life.quarantine.end_trial(b.step_id)
        # Forked children decode from the next step on, after their parent.
        self.queues.running.extend(c for c in b.fork_children if c.status is RUNNING)
        if self._ahead is not None:  # the step planned ahead is in flight from now on
            self._inflight, self._ahead = self._ahead, None
            self._promote(self._inflight)
        return outputs

    def _promote(self, a: PlanBuilder) -> None:
        """Count the step ahead `a`, now in flight, as `schedule()` would have planned it."""
        opened = {index for index, _ in a.lane_blocks}
        for index, seq in enumerate(a.lanes):
            if seq.status is not RUNNING:
                a.num_finished += 1  # finished on the token it sampled: its row is dropped
                continue
            n = len(seq.token_ids)
            seq.plan_lane(a.step_id, n)
            if index in opened:
                seq.lanes_until(self.rule.lane_cap(seq))
            if self.config.enable_prefix_caching and not n % self.config.block_size:
                a.lane_fills.append(seq)
        self.iteration_tokens = len(a.lanes)


def _opens_a_block(seq: Sequence, block_size: int) -> bool:
    """Past its lane_cap only because its token ahead is the first of a new block."""
    n = len(seq.token_ids) + 1
    return (not seq.shared_tail and not seq.needs_full_send
            and seq.lane_cap == seq.num_blocks_sent * block_size == n - 1
            and seq.num_reserved_tokens == n - 1 == seq.num_tokens_sent
            and n <= seq.num_prompt_tokens + seq.request.max_output_tokens - 2)
