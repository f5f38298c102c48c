"""A request's life in the Scheduler: queued, admitted, forked, preempted, finished.

`RequestLifecycle` is the base class of `Scheduler` (scheduler.py): the Scheduler holds the
state (its `__init__`) and plans each step (`schedule`); this half moves requests and their
sequences between the queues and keeps the counts - requests in and out (`add`, `abort`,
`stop`, `reset_device_state` when the workers lost the device pool), a step's result applied
(`update`: sampled tokens, stop rules), samples forked and sequences preempted, the finish of a
sequence or request - and reports (`stats`, `take_finished`). Like the planning half, it hands
its helpers (`admission`, `results`, `quarantine`, `slots`) narrow collaborators only.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

from pagedserve.pipeline.messages import Fork, PromptLogprobs, StepPlan, StepResult
from pagedserve.pipeline.scheduler.admission import RequestRejected, admit_request
from pagedserve.pipeline.scheduler.lookahead import promote
from pagedserve.pipeline.scheduler.plan import PlanBuilder
from pagedserve.pipeline.scheduler.preemption import SWAP
from pagedserve.pipeline.scheduler.results import advance
from pagedserve.pipeline.scheduler.slots import sync_kv
from pagedserve.pipeline.scheduler.sequence import (FINISH_REASONS, STATUS_FOR_REASON, Request,
                                                    RequestState, Sequence, SequenceStatus)
from pagedserve.pipeline.scheduler.step_outputs import SequenceOutput, StepOutputs

RUNNING = SequenceStatus.RUNNING
WAITING = SequenceStatus.WAITING
SWAPPED = SequenceStatus.SWAPPED
FINISHED_STOPPED = SequenceStatus.FINISHED_STOPPED
FINISHED_LENGTH = SequenceStatus.FINISHED_LENGTH
FINISHED_ABORTED = SequenceStatus.FINISHED_ABORTED


@dataclass(slots=True)
class Recovery:
    """What `reset_device_state` did: sequences queued for recompute, and requests failed
    because they were in quarantine.MAX_CRASHES steps in a row that crashed the workers
    (request id, the message for its client)."""
    recomputed: int
    failed: list[tuple[str, str]]


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
    # n-gram speculation, cumulative: verifications, draft tokens proposed and accepted, and
    # accepted per draft position (vLLM's spec_decode counters)
    spec_num_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()


class RequestLifecycle:
    """The Scheduler's request-lifecycle methods, over the state its `__init__` sets up."""

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
        if self.proposer is not None and state.pooling is None:  # pooling decodes nothing
            p = state.sampling
            state.speculates = not (p.uses_penalties or p.logprobs is not None
                                    or p.structured_outputs is not None)
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

    def reset_device_state(self, cause: str = "", attributable: bool = False) -> Recovery:
        """The workers lost their KV cache (a rank died, hung or raised): forget the device
        pool and queue the sequences that lived there for recompute.

        The host swap pool lives in shared memory and survives the workers: sequences swapped
        out by completed steps stay swapped and come back by swap-in. Sequences swapped out by
        the step that was lost (its copies may never have happened) are recomputed, as is every
        sequence that was on the device. A recomputed sequence keeps its prompt and generated
        tokens, is sent to the workers in full again, and samples only once it has caught up:
        streams resume where they stopped.

        `attributable`: the loss may have been caused by what the step computed (the worker
        raised or crashed, rather than being killed from outside). Then every request of the
        lost step becomes a suspect, and one that was already in the previous such step
        without sampling in between (quarantine.MAX_CRASHES) is failed alone, with a message naming
        `cause`, so that the others can complete.
        """
        kv, lost = self.kv, self._inflight
        unreliable = [cpu for _gpu, cpu in lost.swap_out] if lost is not None else []
        dropped = set(kv.drop_device_pool(unreliable))
        self._inflight = self._ahead = None
        self._finished_seq_ids = []
        culprits = self.quarantine.record_crash(self._requests_of(lost)) \
            if attributable and lost is not None else []
        live = [s for s in self.seqs.values() if not s.is_finished]
        self.waiting, self.swapped, self.running, self.prefilling = [], [], [], []
        self.num_running = self.num_swapped = self.num_waiting = self.num_unforked = 0
        for seq in live:
            seq.workers_reset()
            if seq.seq_id in kv and seq.seq_id not in dropped:  # swapped out, host copy intact
                seq.swapped_out()
                self.num_swapped += 1
                self.swapped.append((self.policy.key(seq), seq))
            else:
                seq.drop_kv()
                seq.queued()
                self.num_waiting += 1
                self.waiting.append((self.policy.key(seq), seq))
        heapq.heapify(self.waiting)
        heapq.heapify(self.swapped)
        failed = []
        for req in culprits:
            self._finish_request(req.request_id, FINISHED_ABORTED, None)
            failed.append((req.request_id, (
                f"request {req.request_id!r} was in {req.crashes} steps in a row that crashed "
                f"the worker group (last: {cause or 'unknown cause'}); it was failed so that "
                f"the other requests could complete")))
        return Recovery(self.num_waiting, failed)

    def _requests_of(self, step: PlanBuilder) -> list[RequestState]:
        """The live requests a step computed, in its order (a request once per sequence)."""
        return [seq.request for seq in (*step.lanes, *step.seqs, *step.fork_children)
                if seq.request.request_id in self.requests]

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def take_finished(self) -> list[RequestState]:
        """The requests that finished since the last call (their sequences keep their tokens)."""
        done, self._finished_requests = self._finished_requests, []
        return done

    def stats(self) -> SchedulerStats:
        kv = self.kv.stats()
        return SchedulerStats(
            num_running=self.num_running, num_waiting=self.num_waiting,
            num_swapped=self.num_swapped, kv_usage=self.kv.usage,
            prefix_cache_queries=kv.prefix_queries, prefix_cache_hits=kv.prefix_hits,
            num_preemptions=self.num_preemptions, prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens, iteration_tokens=self.iteration_tokens,
            spec_num_drafts=self.spec_num_drafts, spec_draft_tokens=self.spec_draft_tokens,
            spec_accepted_tokens=self.spec_accepted_tokens,
            spec_accepted_per_pos=tuple(self.spec_accepted_per_pos))

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
        outputs, pending, pooled = advance(b, result, self.kv, block_size=self.block_size,
                                           caching=self.config.enable_prefix_caching,
                                           stop_id_union=self.stop_id_union)
        if result.prompt_logprobs:  # before the stop rules finish (and forget) sequences
            outputs.prompt_logprobs = self._new_prompt_logprobs(result)
        if pooled:  # finished in sequence order, as the stop rules below
            pooled.sort(key=_seq_id)
            outputs.others.extend(self._finish_pooled(pooled, result))
        if pending:
            # Stop rules in sequence order, whatever the plan's encoding: the blocks they free
            # go back to the pool in the same order either way.
            pending.sort(key=_seq_id_of_sampled)
            outputs.others.extend(self._finish_sampled(seq, token, row, result)
                                  for seq, token, row in pending)
        self.generation_tokens += len(outputs.seqs) + sum(len(o.new_token_ids)
                                                          for o in outputs.others)
        if b.verified:
            self._count_verified(b.verified)
        if self.quarantine.on_trial is not None:
            self.quarantine.end_trial(self._sampled_in(self.quarantine.on_trial, b))
        # Forked children decode from the next step on, after their parent.
        self.running.extend(c for c in b.fork_children if c.status is RUNNING)
        if self._ahead is not None:  # the step planned ahead is in flight from now on
            self._inflight, self._ahead = self._ahead, None
            self.iteration_tokens = promote(self._inflight, self._lane_cap,
                                            block_size=self.block_size,
                                            caching=self.config.enable_prefix_caching)
        return outputs

    def _new_prompt_logprobs(self, result: StepResult) -> list[tuple[str, PromptLogprobs]]:
        """The chunks of prompt logprobs the result carries that no earlier step passed on."""
        out = []
        for seq_id, chunk in result.prompt_logprobs:
            seq = self.seqs.get(seq_id)
            if seq is None:
                continue  # aborted while the step ran
            new = seq.request.take_prompt_logprobs(chunk)
            if new is not None:
                out.append((seq.request.request_id, new))
        return out

    def _finish_sampled(self, seq: Sequence, token: int, row: int, result: StepResult
                        ) -> SequenceOutput:
        """The output for the freshly appended tokens (the sampled one, after the spec_skip
        drafts accepted before it), applying the stop rules to each in turn: tokens after
        the one that finishes the sample are dropped."""
        req, tokens = seq.request, seq.token_ids
        first = len(tokens) - 1 - seq.spec_skip  # index of the first new token
        status = None
        for i in range(first, len(tokens)):
            num_out = i + 1 - seq.num_prompt_tokens
            if tokens[i] in req.stop_ids and num_out >= req.min_tokens:
                status = FINISHED_STOPPED
            elif num_out >= req.max_output_tokens:
                status = FINISHED_LENGTH
            else:
                continue
            del tokens[i + 1:]
            break
        new = tokens[first:]
        request_finished = status is not None and self._finish(seq, status)
        lp = None if result.logprobs is None else [result.logprobs[row]]
        tlp = None if result.top_logprobs is None else [result.top_logprobs[row]]
        return SequenceOutput(req.request_id, seq.index, new, FINISH_REASONS.get(status),
                              request_finished, lp, tlp, first - seq.num_prompt_tokens)

    def _finish_pooled(self, seqs: list[Sequence], result: StepResult) -> list[SequenceOutput]:
        """Embedding requests whose prompt the step completed: each finishes with the vector
        the workers pooled for it (its blocks go back to the pool, its full ones findable)."""
        vectors = dict(zip(result.pooled_seq_ids, result.pooled))
        outputs = []
        for seq in seqs:
            vector = vectors.get(seq.seq_id)
            if vector is None:
                raise ValueError(f"StepResult for step {result.step_id} has no pooled vector "
                                 f"for sequence {seq.seq_id}, which completed its prompt")
            seq.pooled(vector)
            done = self._finish(seq, FINISHED_STOPPED)
            outputs.append(SequenceOutput(seq.request.request_id, seq.index, [], "stop", done,
                                          embedding=vector))
        return outputs

    def _count_verified(self, verified: list[tuple[int, int]]) -> None:
        per_pos = self.spec_accepted_per_pos
        for drafted, accepted in verified:
            self.spec_num_drafts += 1
            self.spec_draft_tokens += drafted
            self.spec_accepted_tokens += accepted
            for pos in range(accepted):
                per_pos[pos] += 1

    # ------------------------------------------------------- sequences forked and preempted

    def _fork_samples(self, parent: Sequence, b: PlanBuilder) -> None:
        """The step that completes the parent's prompt: its n - 1 siblings share every block
        and sample from the same logits."""
        req = parent.request
        req.forked = True
        sync_kv(parent, self.kv)
        parent.share_tail()
        children = []
        for index in range(1, req.sampling.n):
            child = self._new_seq(req, index, parent.token_ids[:])
            self.kv.fork(parent.seq_id, child.seq_id)
            child.fork_from(parent, b.step_id)
            children.append(child)
        self.num_running += len(children)
        self.num_unforked -= len(children)
        rows = [self.kv.row_of(c.seq_id) for c in children] if self._shared_tables else []
        b.forks.append(Fork(parent.seq_id, [c.seq_id for c in children], rows))
        b.fork_children.extend(children)

    def _preempt(self, seq: Sequence, b: PlanBuilder) -> None:
        """Push a running sequence out: to the host pool or back to the waiting queue."""
        kv = self.kv
        sync_kv(seq, self.kv)
        if self.sliding_window:  # only the blocks its next step reads are worth swapping
            kv.slide_window(seq.seq_id, seq.num_computed_tokens)
        # full blocks by computed tokens: a reserved slot past them (drafts) is written later
        can_swap = kv.num_cpu_blocks > 0 and kv.can_swap_out(seq.seq_id, seq.num_computed_tokens)
        self.num_preemptions += 1
        self._remove_running(seq)
        seq.preempted(b.step_id)
        if self.preemption.choose(len(seq.token_ids), can_swap) == SWAP:
            b.swap_out.extend(kv.swap_out(seq.seq_id, seq.num_computed_tokens))
            seq.swapped_out()
            self.num_swapped += 1
            heapq.heappush(self.swapped, (self.policy.key(seq), seq))
        else:
            kv.free(seq.seq_id)
            seq.drop_kv()
            self._push_waiting(seq)

    # ------------------------------------------------------------------ bookkeeping

    @staticmethod
    def _sampled_in(req: RequestState, b: PlanBuilder) -> bool:
        """A sequence of `req` sampled in step `b` (it caught up: not still recomputing)."""
        return any(seq.last_step == b.step_id and (len(seq.token_ids) == seq.num_computed_tokens + 1
                                                   or seq.embedding is not None)
                   for seq in req.seqs)

    def _room_for(self, num_seqs: int) -> bool:
        """num_seqs more sequences fit under max_num_seqs, counting samples not yet forked."""
        return self.num_running + self.num_unforked + num_seqs <= self.config.max_num_seqs

    def _add_running(self, seq: Sequence) -> None:
        seq.started()
        self.num_running += 1
        self.num_unforked += seq.request.num_seq_slots - 1

    def _remove_running(self, seq: Sequence) -> None:
        """Before `seq` leaves RUNNING (preempted or finished)."""
        self.num_running -= 1
        self.num_unforked -= seq.request.num_seq_slots - 1

    def _new_seq(self, req: RequestState, index: int, token_ids: list[int]) -> Sequence:
        seq = Sequence(self._next_seq_id, req, index, token_ids)
        self._next_seq_id += 1
        self.seqs[seq.seq_id] = seq
        req.seqs.append(seq)
        return seq

    def _push_waiting(self, seq: Sequence) -> None:
        seq.queued()
        self.num_waiting += 1
        heapq.heappush(self.waiting, (self.policy.key(seq), seq))

    def _finish(self, seq: Sequence, status: SequenceStatus) -> bool:
        """Release a sequence; returns whether that finished its whole request."""
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
        seq.finished_as(status)
        del self.seqs[seq.seq_id]
        if self.proposer is not None:
            self.proposer.forget(seq.seq_id)
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
        if self.grammar_book is not None:
            self.grammar_book.forget(req.request_id, [s.seq_id for s in req.seqs])
        if self.config.report_finished:
            self._finished_requests.append(req)
        self.quarantine.forget(req)
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


def _seq_id_of_sampled(item: tuple[Sequence, int, int]) -> int:
    return item[0].seq_id


def _seq_id(seq: Sequence) -> int:
    return seq.seq_id
