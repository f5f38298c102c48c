"""A request's life in the scheduler: queued, admitted, forked, preempted, finished.

`RequestLifecycle` owns the requests and their sequences, what finished since the service and
the workers last heard (`take_finished`, `take_finished_seq_ids`), and the counts of requests
in and out.
"""
from __future__ import annotations

from pagedserve.pipeline.messages import Fork, PromptLogprobs, StepResult
from pagedserve.pipeline.scheduler.admission import RequestRejected, admit_request
from pagedserve.pipeline.scheduler.config import SchedulerConfig
from pagedserve.pipeline.scheduler.plan import PlanBuilder
from pagedserve.pipeline.scheduler.preemption import SWAP, swap_or_recompute
from pagedserve.pipeline.scheduler.quarantine import Quarantine
from pagedserve.pipeline.scheduler.queues import SequenceQueues
from pagedserve.pipeline.scheduler.sequence import (FINISH_REASONS, FINISHED_LENGTH,
                                                    FINISHED_STOPPED, SWAPPED, WAITING, Request,
                                                    RequestState, Sequence, SequenceStatus)
from pagedserve.pipeline.scheduler.speculative import NgramProposer
from pagedserve.pipeline.scheduler.step_outputs import SequenceOutput


class RequestLifecycle:
    def __init__(self, config: SchedulerConfig, kv, queues: SequenceQueues,
                 eos_token_ids: frozenset[int]) -> None:
        self.config = config
        self.kv = kv
        self.queues = queues
        self.eos_token_ids = eos_token_ids
        self.requests: dict[str, RequestState] = {}
        self.seqs: dict[int, Sequence] = {}  # live (unfinished) sequences
        # Every stop id any request has had: a step none of whose tokens is here stops nothing.
        self.stop_id_union: set[int] = set(eos_token_ids)
        self.num_queued_requests = 0  # never admitted yet: bounded by max_queued_requests
        self.num_preemptions = self.prompt_tokens = 0
        self._next_seq_id = 0
        self._finished_seq_ids: list[int] = []  # the workers still hold state for these
        # Requests finished since the service last took them: it keeps their outputs a while,
        # for a detokenizer that died before delivering them.
        self._finished_requests: list[RequestState] = []
        self.quarantine = Quarantine()
        self.grammar_book = None  # structured output's matchers; None: not enabled
        spec = config.speculative
        self.proposer = NgramProposer(spec) if spec is not None else None

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise RequestRejected(request.request_id, "a request with this id is already in flight")
        state = admit_request(request, self.config, num_gpu_blocks=self.kv.num_gpu_blocks,
                              num_watermark_blocks=self.kv.watermark_blocks,
                              eos_token_ids=self.eos_token_ids,
                              num_queued=self.num_queued_requests)
        seq = self._new_seq(state, 0, [*request.prompt_token_ids, *request.output_token_ids])
        if self.proposer is not None and state.pooling is None:  # pooling decodes nothing
            p = state.sampling
            state.speculates = not (p.uses_penalties or p.logprobs is not None
                                    or p.structured_outputs is not None)
        self.requests[state.request_id] = state
        self.stop_id_union |= state.stop_ids
        self.num_queued_requests += 1
        self.queues.push_waiting(seq)

    def admitted(self, req: RequestState) -> None:
        """A sequence of `req` got its first blocks: the request is no longer queued."""
        if req.queued:
            req.queued = False
            self.num_queued_requests -= 1
            self.prompt_tokens += req.num_prompt_tokens

    def take_finished(self) -> list[RequestState]:
        done, self._finished_requests = self._finished_requests, []
        return done

    def take_finished_seq_ids(self) -> list[int]:
        """Sequences finished since the last plan whose state the workers still hold."""
        done, self._finished_seq_ids = self._finished_seq_ids, []
        return done

    def requests_of(self, step: PlanBuilder) -> list[RequestState]:
        """The live requests a step computed, in its order (a request once per sequence)."""
        return [seq.request for seq in (*step.lanes, *step.seqs, *step.fork_children)
                if seq.request.request_id in self.requests]

    def fork_samples(self, parent: Sequence, b: PlanBuilder) -> None:
        """The step that completes the parent's prompt: its n - 1 siblings share every block
        and sample from the same logits."""
        req = parent.request
        req.forked = True
        parent.sync_kv(self.kv)
        parent.share_tail()
        children = []
        for index in range(1, req.sampling.n):
            child = self._new_seq(req, index, parent.token_ids[:])
            self.kv.fork(parent.seq_id, child.seq_id)
            child.fork_from(parent, b.step_id)
            children.append(child)
        self.queues.forked(len(children))
        rows = ([self.kv.row_of(c.seq_id) for c in children]  # for workers that read the
                if self.kv.block_tables is not None else [])  # block tables from shared rows
        b.forks.append(Fork(parent.seq_id, [c.seq_id for c in children], rows))
        b.fork_children.extend(children)

    def preempt(self, seq: Sequence, b: PlanBuilder) -> None:
        """Push a running sequence out: to the host pool or back to the waiting queue."""
        kv = self.kv
        seq.sync_kv(kv)
        if self.config.sliding_window:  # only the blocks its next step reads are worth swapping
            kv.slide_window(seq.seq_id, seq.num_computed_tokens)
        # full blocks by computed tokens: a reserved slot past them (drafts) is written later
        can_swap = kv.num_cpu_blocks > 0 and kv.can_swap_out(seq.seq_id, seq.num_computed_tokens)
        self.num_preemptions += 1
        self.queues.leave(seq)
        seq.preempted(b.step_id)
        if swap_or_recompute(self.config.preemption_mode, len(seq.token_ids), can_swap,
                             self.config.swap_threshold_tokens) == SWAP:
            b.swap_out.extend(kv.swap_out(seq.seq_id, seq.num_computed_tokens))
            self.queues.push_swapped(seq)
        else:
            kv.free(seq.seq_id)
            seq.drop_kv()
            self.queues.push_waiting(seq)

    def finish(self, seq: Sequence, status: SequenceStatus, inflight: PlanBuilder | None
               ) -> bool:
        """Release a sequence; returns whether that finished its whole request."""
        if inflight is not None and seq.last_step == inflight.step_id:
            inflight.num_finished += 1  # its row is no longer wanted: update goes one by one
        if seq.status <= SWAPPED:
            if seq.status is not WAITING:
                self.kv.free(seq.seq_id)
            self.queues.leave(seq)
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

    def finish_request(self, request_id: str, status: SequenceStatus, index: int | None,
                       inflight: PlanBuilder | None) -> list[SequenceOutput]:
        """Finish sample `index` (None: every sample) of a request; unknown ids are ignored."""
        req = self.requests.get(request_id)
        if req is None:
            return []
        outputs = []
        for seq in list(req.seqs):
            if seq.status >= FINISHED_STOPPED or (index is not None and seq.index != index):
                continue
            done = self.finish(seq, status, inflight)
            outputs.append(SequenceOutput(request_id, seq.index, [], FINISH_REASONS[status], done,
                                          offset=len(seq.token_ids) - seq.num_prompt_tokens))
        return outputs

    def finish_sampled(self, seq: Sequence, row: int, result: StepResult) -> SequenceOutput:
        """The output for the freshly appended tokens (the sampled one, after the spec_skip
        drafts accepted before it), applying the stop rules to each in turn: tokens after
        the one that finishes the sample are dropped."""
        req, tokens = seq.request, seq.token_ids
        first = len(tokens) - 1 - seq.spec_skip  # index of the first new token
        status = None
        for i in range(first, len(tokens)):
            num_out = i + 1 - seq.num_prompt_tokens
            if tokens[i] in req.stop_ids and num_out >= req.sampling.min_tokens:
                status = FINISHED_STOPPED
            elif num_out >= req.max_output_tokens:
                status = FINISHED_LENGTH
            else:
                continue
            del tokens[i + 1:]
            break
        new = tokens[first:]
        request_finished = status is not None and self.finish(seq, status, None)
        lp = None if result.logprobs is None else [result.logprobs[row]]
        tlp = None if result.top_logprobs is None else [result.top_logprobs[row]]
        return SequenceOutput(req.request_id, seq.index, new, FINISH_REASONS.get(status),
                              request_finished, lp, tlp, first - seq.num_prompt_tokens)

    def finish_pooled(self, seqs: list[Sequence], result: StepResult) -> list[SequenceOutput]:
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
            done = self.finish(seq, FINISHED_STOPPED, None)
            outputs.append(SequenceOutput(seq.request.request_id, seq.index, [], "stop", done,
                                          embedding=vector))
        return outputs

    def new_prompt_logprobs(self, result: StepResult) -> list[tuple[str, PromptLogprobs]]:
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

    def _new_seq(self, req: RequestState, index: int, token_ids: list[int]) -> Sequence:
        seq = Sequence(self._next_seq_id, req, index, token_ids)
        self._next_seq_id += 1
        self.seqs[seq.seq_id] = seq
        req.seqs.append(seq)
        return seq
