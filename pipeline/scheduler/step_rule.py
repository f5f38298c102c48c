"""The one scheduling rule, applied to every live sequence of a step in the order `StepRule.plan`
gives (docs/ARCHITECTURE.md, "Schedule"): its computed tokens catch up with its known tokens
(prompt, outputs, drafts) as far as the token budget allows, preempting in policy order when
blocks are short. How a decision is encoded (a lane or a per-sequence entry) is plan.py's.
"""
from __future__ import annotations

from operator import attrgetter

from pagedserve.pipeline.messages import NewSeq, ScheduledSeq
from pagedserve.pipeline.scheduler.config import SchedulerConfig
from pagedserve.pipeline.scheduler.lifecycle import RequestLifecycle
from pagedserve.pipeline.scheduler.plan import NO_BLOCKS, PlanBuilder
from pagedserve.pipeline.scheduler.queues import SequenceQueues
from pagedserve.pipeline.scheduler.sequence import (RUNNING, SWAPPED, WAITING, Sequence,
                                                    SequenceStatus)


class StepRule:
    def __init__(self, config: SchedulerConfig, kv, queues: SequenceQueues,
                 life: RequestLifecycle, policy) -> None:
        self.config = config
        self.kv = kv
        self.queues = queues
        self.life = life
        self.policy = policy

    def plan(self, b: PlanBuilder) -> None:
        """Apply the rule to every live sequence, in step order, into the plan `b`."""
        q = self.queues
        if self.policy.preempts_for_waiting and q.waiting and q.num_running:
            self._preempt_for_waiting(b)
        decodes, chunks = q.next_running(), []
        self._schedule_decodes(b, decodes)
        for seq in q.prefilling:
            if seq.status is RUNNING:
                if self.config.sliding_window:
                    self.kv.slide_window(seq.seq_id, seq.num_computed_tokens)
                self._place(seq, self._catch_up(seq, b), decodes, chunks)
        if q.swapped and not b.swap_out:
            self._swap_in(b, decodes, chunks)
        if q.waiting:
            for seq in self._joining(b, q.waiting, WAITING, decodes, chunks):
                caught_up = self._admit(seq, b)
                if caught_up is None:
                    break
                self._place(seq, caught_up, decodes, chunks)
        q.planned(decodes, chunks)

    def _schedule_decodes(self, b: PlanBuilder, decodes: list[Sequence]) -> None:
        """The rule for every decoding sequence, in running order. One known to be a steady
        decode (at most lane_cap tokens) goes straight into the decode columns (`plan_lane`);
        the others go through `_decode` at the same point in the order."""
        keep = decodes.append
        lanes = b.lanes
        add_lane, add_lane_token = lanes.append, b.lane_tokens.append
        add_fill = b.lane_fills.append
        bs, step_id = self.config.block_size, b.step_id
        caching = self.config.enable_prefix_caching
        budget = b.budget
        for seq in self.queues.running:
            tokens = seq.token_ids
            n = len(tokens)
            if n > seq.lane_cap or budget <= 0:  # not a lane (a finished or preempted one's is -1)
                b.budget = budget
                is_lane = self._decode(seq, b, keep)
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
        b.lane_ids = list(map(attrgetter("seq_id"), lanes))

    def _decode(self, seq: Sequence, b: PlanBuilder, keep) -> bool:
        """A decoding sequence past its lane_cap (or with no budget left), if still running:
        its catch-up, with drafts when it speculates. True when it is a lane after all, for the
        caller to encode: a one-token decode whose new block the pool gives and whose token
        cannot end it by length."""
        if seq.status is not RUNNING:
            return False  # finished or preempted since
        if self.config.sliding_window:  # its lane_cap ends where its next block slides out
            self.kv.slide_window(seq.seq_id, seq.num_computed_tokens)
        if seq.request.speculates and self._schedule_drafts(seq, b):
            keep(seq)
            return False
        n = len(seq.token_ids)
        new_blocks = None
        if (self.config.decode_lanes and seq.num_computed_tokens + 1 == n
                and seq.num_reserved_tokens < n and not seq.needs_full_send and b.budget > 0):
            if n <= seq.num_blocks_sent * self.config.block_size and not seq.shared_tail:
                new_blocks = NO_BLOCKS  # inside the blocks the workers hold: tell the manager later
                seq.hold_slots(n, reported=False)
            else:  # None: its last block is shared, or the pool is short
                new_blocks = seq.reserve_lane(self.kv, n)
        if new_blocks is None:
            self._catch_up(seq, b)
            if seq.status is RUNNING:
                keep(seq)
            return False
        if not (new_blocks and seq.num_tokens_sent + 1 == n
                and n <= seq.num_prompt_tokens + seq.request.max_output_tokens - 2):
            self._plan_tokens(seq, 1, new_blocks, b)
            keep(seq)
            return False
        seq.sent_tokens_upto(n)  # a lane that opens a new block: the caller adds it next
        b.lane_blocks.extend((len(b.lanes), block) for block in new_blocks)
        seq.lanes_until(self.lane_cap(seq))
        return True

    def _schedule_drafts(self, seq: Sequence, b: PlanBuilder) -> bool:
        """A steady decode of a speculating request: its last token and up to k drafts, in one
        forward. False (nothing planned) when nothing recurs, there is no room, or the pool is
        short: it decodes one token as usual, which may preempt; drafts never do."""
        tokens, spec = seq.token_ids, self.config.speculative
        n = len(tokens)
        if (seq.num_computed_tokens + 1 != n or seq.needs_full_send
                or 0 < spec.disable_by_batch_size < self.queues.num_running):
            return False
        req = seq.request
        k = min(spec.num_speculative_tokens, b.budget - 1,
                req.num_prompt_tokens + req.max_output_tokens - n - 1,
                self.config.max_model_len - n)
        if k <= 0:
            return False
        drafts = self.life.proposer.propose(seq.seq_id, tokens, k)
        if not drafts or not seq.grow(1 + len(drafts), self.kv, b.copy):
            return False
        seq.propose(drafts)
        self._emit(seq, 1, b, drafts)
        return True

    def _chunk(self, seq: Sequence, budget: int) -> tuple[int, bool]:
        """The rule's token count for `seq` and whether it is all that remains: all of it, else
        what the budget leaves when chunked prefill allows a part (0: none)."""
        remaining = len(seq.token_ids) - seq.num_computed_tokens
        if remaining <= budget:
            return remaining, True
        return (budget if self.config.enable_chunked_prefill else 0), False

    def _catch_up(self, seq: Sequence, b: PlanBuilder) -> bool:
        """The rule for a running sequence, preempting by policy when blocks are short (itself,
        last). Whether it reaches the end of its tokens."""
        chunk, completes = self._chunk(seq, b.budget)
        if chunk and self._reserve_or_preempt(seq, chunk, b):
            self._emit(seq, chunk, b)
        return completes

    @staticmethod
    def _place(seq: Sequence, caught_up: bool, decodes: list[Sequence],
               chunks: list[Sequence]) -> None:
        """A planned sequence's place in the next step's order: decodes, then prompts."""
        if seq.status is RUNNING:
            (decodes if caught_up else chunks).append(seq)

    def _joining(self, b: PlanBuilder, heap: list, status: SequenceStatus,
                 decodes: list[Sequence], chunks: list[Sequence]):
        """The heads of a queue, in order, while the sequence cap and the budget allow, and
        each one's samples fit, no other suspect is on trial (quarantine.py) and its LoRA
        adapter keeps the step within --max-loras. The caller stops at the first that does
        not fit now: head-of-line blocking keeps the order fair (no starvation)."""
        q = self.queues
        loras = None  # the step's distinct adapters, worked out when one is first asked for
        while b.budget and q.room_for(1):
            seq = q.head(heap, status)
            if (seq is None or (status is WAITING and seq.preempted_step == b.step_id)
                    or not q.room_for(seq.request.num_seq_slots)
                    or self.life.quarantine.holds_back(seq.request)):
                return  # a waiting one pushed out this very step waits for the next
            lora = seq.request.lora
            if lora is not None:  # the base model takes no adapter slot
                if loras is None:
                    loras = {s.request.lora.lora_int_id for group in (decodes, chunks)
                             for s in group if s.request.lora is not None}
                if lora.lora_int_id not in loras and len(loras) >= self.config.max_loras:
                    return
                loras.add(lora.lora_int_id)
            yield seq
            self.life.quarantine.begin_trial(seq.request)

    def _swap_in(self, b: PlanBuilder, decodes: list[Sequence], chunks: list[Sequence]) -> None:
        kv = self.kv
        for seq in self._joining(b, self.queues.swapped, SWAPPED, decodes, chunks):
            chunk, completes = self._chunk(seq, b.budget)
            if not self._can_swap_in(seq, chunk):
                break
            self.queues.swap_in_head()
            b.swap_in.extend(kv.swap_in(seq.seq_id, seq.num_computed_tokens))
            seq.table_changed()
            # Fresh slots beyond the swapped-in table come without preempting anyone now: a
            # sequence swapped in and out in one step would undo itself.
            if chunk and seq.grow(chunk, kv, b.copy):
                self._emit(seq, chunk, b)
            self._place(seq, completes, decodes, chunks)

    def _can_swap_in(self, seq: Sequence, chunk: int) -> bool:
        """Room above the watermark for its blocks and for the ones its next chunk adds, so a
        swapped-in sequence can run at once instead of being pushed straight back out."""
        kv = self.kv
        if not kv.can_swap_in(seq.seq_id, seq.num_computed_tokens):
            return False
        bs = kv.block_size
        table = -(-seq.num_reserved_tokens // bs)  # blocks a sliding window released included
        held = table - kv.num_released_blocks(seq.seq_id)
        more = max(0, -(-(seq.num_computed_tokens + chunk) // bs) - table)
        return kv.num_free_blocks - held - more >= kv.watermark_blocks

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
        cached = lower = 0  # lower: of the cached tokens, those a lower KV tier loads
        if reads_cache:
            if kv.tiers is None:
                cached = kv.lookup_prefix(tokens, req.cache_salt)
            else:
                cached, lower = kv.lookup_prefix_tiers(tokens, req.cache_salt)
        chunk = total - cached
        if chunk > b.budget:
            if whole or not self.config.enable_chunked_prefill:
                return None
            chunk = b.budget
        if not kv.can_allocate(chunk + lower, num_cached_tokens=cached - lower):
            return None  # the watermark keeps room for running sequences to grow
        got = kv.allocate(seq.seq_id, () if whole else tokens, chunk, req.cache_salt,
                          read_cache=reads_cache)
        if got is None:
            return None
        seq.admitted(got, chunk)
        chunk = min(chunk, total - got)
        self.queues.admit_head()
        self.life.admitted(req)
        self._emit(seq, chunk, b)
        return got + chunk == total

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
                                   seq.request.pooling is not None, seq.request.lora),
                       num_tokens, drafts)
            seq.sent_in_full(len(block_ids), len(tokens))
            self._planned(seq, num_tokens, b)
            return
        num_blocks = -(-seq.num_reserved_tokens // self.config.block_size)
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
        b.add_scheduled(seq, ScheduledSeq(seq.seq_id, num_tokens, new_blocks, unsent, drafts,
                                          seq.take_spec_skip()))
        seq.sent_tokens_upto(len(tokens))
        self._planned(seq, num_tokens, b)

    def _planned(self, seq: Sequence, num_tokens: int, b: PlanBuilder) -> None:
        if not seq.planned(num_tokens, b.step_id):
            seq.lanes_until(-1)  # mid-prefill: it samples nothing this step
            return
        if not seq.request.forked:
            self.life.fork_samples(seq, b)
        seq.lanes_until(self.lane_cap(seq) if self.config.decode_lanes else -1)

    def lane_cap(self, seq: Sequence) -> int:
        """For a sequence just planned to compute up to the end of its tokens: the largest token
        count at which its following steps are lanes (-1: none; docs/INTERFACES.md, "Decode
        lanes"): short of max_tokens, so that `update` need not check a lane's length."""
        n = len(seq.token_ids)
        if (seq.request.speculates  # its decodes may carry drafts: planned one by one
                or seq.shared_tail or seq.needs_full_send or seq.num_reserved_tokens != n
                or seq.num_tokens_sent != n):
            return -1
        cap = min(seq.num_blocks_sent * self.config.block_size,
                  seq.num_prompt_tokens + seq.request.max_output_tokens - 2)
        if self.config.sliding_window:
            cap = min(cap, self.kv.window_release_at(seq.seq_id))
        return cap

    def _reserve_or_preempt(self, seq: Sequence, num_new: int, b: PlanBuilder) -> bool:
        """Make room for `num_new` more tokens of `seq`, preempting others (or `seq` itself,
        returning False) when the pool is short."""
        while not seq.grow(num_new, self.kv, b.copy):
            victim = self.queues.victim(b.step_id)
            if victim is None:
                raise RuntimeError(f"seq {seq.seq_id} is short of blocks and no sequence is left "
                                   "to preempt, itself included")
            self.life.preempt(victim, b)
            if victim is seq:
                return False
        return True

    def _preempt_for_waiting(self, b: PlanBuilder) -> None:
        """Let the waiting head push out running sequences it outranks when blocks are short."""
        q = self.queues
        head = q.head(q.waiting, WAITING)
        if head is None:
            return
        tokens = head.token_ids
        cached = (self.kv.lookup_prefix(tokens, head.request.cache_salt)
                  if self.config.enable_prefix_caching
                  and not head.request.wants_prompt_logprobs else 0)
        need = min(len(tokens) - cached, self.config.max_num_batched_tokens)
        while not self.kv.can_allocate(need, num_cached_tokens=cached):
            victim = q.victim(b.step_id)
            if victim is None or not self.policy.may_preempt(head, victim):
                return
            self.life.preempt(victim, b)
