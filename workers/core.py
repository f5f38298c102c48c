"""The socket-free heart of a worker rank: applies one StepPlan to its sequence state and KV
cache, runs the model, and (on rank 0) samples. The worker process only adds the sockets.

Plan order (pipeline/messages.py): finished_seq_ids, new_seqs, swap_out, swap_in, copy, then the
scheduled sequences, then forks.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from pagedserve import kernels
from pagedserve.shm_tables import SharedBlockTables
from pagedserve.pipeline.lora_request import LoRARequest
from pagedserve.pipeline.messages import (NewSeq, PromptLogprobs, SharedTables, StepPlan,
                                          StepResult)
from pagedserve.pipeline.pooling import to_bytes
from pagedserve.pipeline.sampling_params import SamplingParams
from pagedserve.workers.kv_cache import allocate_swap_pool
from pagedserve.workers.model_runner import ModelRunner, SeqStep
from pagedserve.workers.sampler import Sampler
from pagedserve.workers.sampling.grammar_mask import apply_grammar_masks
from pagedserve.workers.sampling.speculative import verify_drafts

log = logging.getLogger(__name__)


def child_sampling(params: SamplingParams, sample_index: int) -> SamplingParams:
    """Params of the `sample_index`-th sample of an n > 1 request (see SamplingParams.for_sample)."""
    return params.for_sample(sample_index)


@dataclass(slots=True)
class SeqState:
    token_ids: list[int]          # prompt + outputs known to the workers
    num_prompt_tokens: int
    sampling: SamplingParams
    block_ids: list[int]          # from the plans' diffs
    num_computed_tokens: int
    table_row: int = -1           # its row in the scheduler's shared block tables
    pool: bool = False            # an embedding prompt: pooled, not sampled, at its end
    lora_id: int = 0              # its LoRA adapter's id (runner.lora holds it); 0: none

    def clone(self, table_row: int) -> SeqState:
        return SeqState(list(self.token_ids), self.num_prompt_tokens, self.sampling,
                        list(self.block_ids), self.num_computed_tokens, table_row, self.pool,
                        self.lora_id)


class WorkerCore:
    def __init__(self, runner: ModelRunner, sampler: Sampler | None, num_cpu_blocks: int = 0,
                 swap_shm_name: str | None = None) -> None:
        """`sampler` is given on rank 0 only; other ranks compute and return None. With
        `swap_shm_name` the host swap pool is shared memory that survives this process."""
        self.runner, self.sampler = runner, sampler
        self.swap_pool = allocate_swap_pool(runner.kv_cache, num_cpu_blocks, swap_shm_name)
        self.seqs: dict[int, SeqState] = {}
        self.tables: SharedBlockTables | None = None  # attached per plan.shared_tables
        # PAGEDSERVE_STEP_TRACE: workers/step_trace.py times the forward's parts (rank 0)
        self.profiler = None
        self._tables_ref: SharedTables | None = None
        # rank 0: the last step's result, whose tokens a plan made ahead of it decodes
        self._last_result: StepResult | None = None
        self.tiers = None  # the KV tiers' host blocks and disk files (workers/kv_tiers.py)
        # seq_id -> tokens recomputed this step before its scheduled ones (a failed tier load)
        self._recompute: dict[int, int] = {}

    def reset(self) -> None:
        """Forget every sequence (a new scheduler epoch); the KV cache's bytes are simply
        overwritten by whatever the next plans compute. The shared tables are attached again
        from the next plan (a new scheduler creates a new segment under the same name)."""
        self.seqs.clear()
        self._last_result = None
        self._attach_tables(None)

    def _attach_tables(self, ref: SharedTables | None) -> None:
        if ref == self._tables_ref:
            return
        self.runner.shared_tables = None
        if self.tables is not None:
            self.tables.close()
        self.tables, self._tables_ref = None, ref
        if ref is None:
            return
        try:
            self.tables = SharedBlockTables.attach(ref.name, ref.rows, ref.width)
        except (OSError, ValueError) as exc:  # another host: the plans' block ids serve
            log.warning("shared block tables %r unavailable (%s); using the plans' block ids",
                        ref.name, exc)
            return
        self.runner.shared_tables = self.tables.array
        log.info("block tables: reading shared memory %s [%d x %d]", ref.name, ref.rows, ref.width)

    def execute(self, plan: StepPlan) -> StepResult | None:
        self._attach_tables(plan.shared_tables)
        for seq_id in plan.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        for new in plan.new_seqs:
            self._register(new)
        if plan.tiers is not None:
            self._move_tiers(plan)
        self._move_blocks(plan)

        items, sampled_ids, pooled_ids = self._collect(plan)
        started = time.perf_counter()
        step = self.runner.run(items)
        logits = step.logits
        forward_done = time.perf_counter()
        seqs = self.seqs
        for seq_id in plan.decode_seq_ids:
            seqs[seq_id].num_computed_tokens += 1
        for scheduled in plan.scheduled:
            seqs[scheduled.seq_id].num_computed_tokens += scheduled.num_tokens
        if self._recompute:
            for seq_id, extra in self._recompute.items():
                seqs[seq_id].num_computed_tokens += extra
            self._recompute.clear()

        drafts = {s.seq_id: s.draft_token_ids for s in plan.scheduled if s.draft_token_ids}
        rows = _first_rows(sampled_ids, drafts)
        row_ids = list(sampled_ids)
        for fork in plan.forks:
            parent = self._state(fork.parent_id, "fork")
            table_rows = fork.child_rows or [-1] * len(fork.child_ids)
            for index, (child_id, table_row) in enumerate(zip(fork.child_ids, table_rows), 1):
                child = parent.clone(table_row)
                child.sampling = child_sampling(parent.sampling, index)
                self.seqs[child_id] = child
                if fork.parent_id in rows:
                    row_ids.append(child_id)
                    rows[child_id] = rows[fork.parent_id]
        if self.sampler is None:
            return None
        if drafts:
            result = self._verify(plan, logits, row_ids, rows, drafts)
        else:
            result = self._sample(plan, logits, row_ids, [rows[s] for s in row_ids])
        if step.prompt:
            result.prompt_logprobs = _prompt_chunks(plan, items, step.prompt)
        if pooled_ids:
            result.pooled_seq_ids = pooled_ids
            result.pooled = [to_bytes(v) for v in step.pooled.cpu().numpy()]
        if self.tiers is not None:
            result.tier_failed = self.tiers.take_failed()
        self._last_result = result
        if self.profiler is not None:
            result.timings = {"forward_ms": (forward_done - started) * 1e3,
                              "sample_ms": (time.perf_counter() - forward_done) * 1e3,
                              **self.profiler.take()}
        return result

    def _register(self, new: NewSeq) -> None:
        sampling = new.sampling  # per sample: the scheduler sends a child its derived params
        lora_id = self._register_lora(new.lora) if new.lora is not None else 0
        self.seqs[new.seq_id] = SeqState(
            list(new.prompt_token_ids) + list(new.output_token_ids), len(new.prompt_token_ids),
            sampling, list(new.block_ids), new.num_computed_tokens, new.table_row, new.pool,
            lora_id)

    def _register_lora(self, lora: LoRARequest) -> int:
        """A new sequence's adapter, loaded into host memory on first sight: its id."""
        if self.runner.lora is None:
            raise ValueError(f"a sequence uses LoRA adapter {lora.lora_name!r} but this worker "
                             "runs without --enable-lora")
        self.runner.lora.register(lora)
        return lora.lora_int_id

    def _move_tiers(self, plan: StepPlan) -> None:
        """The plan's KV tier moves (workers/kv_tiers.py). A disk load that failed leaves its
        device block unfilled: every new sequence counting it as computed computes again from
        that block on, in this step (the scheduler's counts are the same at the step's end)."""
        if self.tiers is None:
            raise ValueError(f"plan {plan.step_id} moves KV tier blocks but this worker has no "
                             "KV tiers (--kv-offload-memory / --kv-offload-dir)")
        unfilled = self.tiers.apply(plan.tiers)
        if not unfilled:
            return
        bs = self.runner.block_size
        for new in plan.new_seqs:
            state = self.seqs[new.seq_id]
            computed = state.block_ids[:state.num_computed_tokens // bs]
            first = next((i for i, b in enumerate(computed) if b in unfilled), None)
            if first is not None:
                self._recompute[new.seq_id] = state.num_computed_tokens - first * bs
                state.num_computed_tokens = first * bs

    def _move_blocks(self, plan: StepPlan) -> None:
        kv_cache = self.runner.kv_cache
        if plan.swap_out:
            kernels.swap_blocks(kv_cache, self.swap_pool, _mapping(plan.swap_out, kv_cache.device))
        if plan.swap_in:
            kernels.swap_blocks(self.swap_pool, kv_cache, _mapping(plan.swap_in, kv_cache.device))
        if plan.copy:
            kernels.copy_blocks(kv_cache, _mapping(plan.copy, kv_cache.device))

    def _collect(self, plan: StepPlan) -> tuple[list[SeqStep], list[int], list[int]]:
        """The step's items, the sequences that sample (in row order) and those pooled."""
        items, sampled_ids, pooled_ids = [], [], []
        shared = self.tables is not None
        if len(plan.decode_token_ids) != len(plan.decode_seq_ids):
            raise ValueError(f"plan {plan.step_id} has {len(plan.decode_seq_ids)} decode_seq_ids "
                             f"but {len(plan.decode_token_ids)} decode_token_ids")
        for index, block in plan.decode_new_blocks:
            if not 0 <= index < len(plan.decode_seq_ids):
                raise ValueError(f"plan {plan.step_id}: decode_new_blocks names column {index} "
                                 f"of {len(plan.decode_seq_ids)}")
            self._state(plan.decode_seq_ids[index], "decoding").block_ids.append(block)
        for seq_id, token in zip(plan.decode_seq_ids, self._decode_tokens(plan)):
            state = self._state(seq_id, "decoding")
            tokens = state.token_ids
            start = state.num_computed_tokens
            if start != len(tokens):
                raise ValueError(f"seq {seq_id}: a decode column entry, but {len(tokens) - start} "
                                 f"of its known tokens are not computed yet")
            tokens.append(token)
            items.append(SeqStep([token], start, state.block_ids, True,
                                 state.table_row if shared else -1, lora_id=state.lora_id))
        sampled_ids.extend(plan.decode_seq_ids)
        for scheduled in plan.scheduled:
            state = self._state(scheduled.seq_id, "scheduled")
            state.block_ids.extend(scheduled.new_block_ids)
            state.token_ids.extend(scheduled.new_token_ids)
            state.num_computed_tokens += scheduled.num_skipped  # drafts accepted last step
            start = state.num_computed_tokens
            end = start + scheduled.num_tokens + self._recompute.get(scheduled.seq_id, 0)
            if end > len(state.token_ids) or scheduled.num_skipped > len(scheduled.new_token_ids):
                raise ValueError(f"seq {scheduled.seq_id}: asked to compute tokens [{start}, {end}) "
                                 f"but only {len(state.token_ids)} are known (skipping "
                                 f"{scheduled.num_skipped} accepted drafts)")
            sample = end == len(state.token_ids)
            drafts = scheduled.draft_token_ids
            if drafts and not sample:
                raise ValueError(f"seq {scheduled.seq_id}: drafts after a step that does not "
                                 f"reach the end of its tokens")
            row = state.table_row if shared else -1
            computed = state.token_ids[start:end] + drafts if drafts else state.token_ids[start:end]
            if sample and state.pool:  # an embedding prompt's end: pooled, nothing sampled
                items.append(SeqStep(computed, start, state.block_ids, False, row, pool=True))
                pooled_ids.append(scheduled.seq_id)
                continue
            item = SeqStep(computed, start, state.block_ids, sample, row, len(drafts),
                           lora_id=state.lora_id)
            if self.sampler is not None and state.sampling.prompt_logprobs is not None \
                    and start < state.num_prompt_tokens - 1:
                # rows start .. predict prompt tokens start + 1 .., up to the last one
                item.prompt_targets = state.token_ids[
                    start + 1:min(end, state.num_prompt_tokens - 1) + 1]
                item.prompt_top = state.sampling.prompt_logprobs
            items.append(item)
            if sample:
                sampled_ids.append(scheduled.seq_id)
        return items, sampled_ids, pooled_ids

    def _decode_tokens(self, plan: StepPlan) -> list[int]:
        """The decode columns' input tokens: the plan's, or for a plan made before the last
        step's result was back (overlapped scheduling) the ones rank 0 sampled then, which
        the other ranks of a tensor-parallel group receive by broadcast (-1: sampled none)."""
        if not plan.ahead:
            return plan.decode_token_ids
        tp = self.runner.tp
        if self.sampler is None and tp.size == 1:
            raise ValueError(f"plan {plan.step_id} follows the last step's samples, but this "
                             "rank does not sample")
        if self.sampler is not None:
            last = self._last_result
            sampled = dict(zip(last.seq_ids, last.token_ids)) if last is not None else {}
            tokens = [sampled.get(seq_id, -1) for seq_id in plan.decode_seq_ids]
        else:
            tokens = [-1] * len(plan.decode_seq_ids)
        if tp.size > 1:
            shared = torch.tensor(tokens, dtype=torch.int64, device=self.runner.device)
            tokens = tp.broadcast_from_first(shared).tolist()
        for seq_id, token in zip(plan.decode_seq_ids, tokens):
            if token < 0:
                raise ValueError(f"plan {plan.step_id} follows the last step's samples, but seq "
                                 f"{seq_id} sampled nothing yet")
        return tokens

    def _sample(self, plan: StepPlan, logits: torch.Tensor, seq_ids: list[int],
                rows: list[int], logits_read_later: bool = False) -> StepResult:
        step_id = plan.step_id
        if not seq_ids:
            return StepResult(step_id, [], [], None, None)
        if rows != list(range(logits.shape[0])):
            logits = logits[torch.tensor(rows, device=logits.device)]
        if plan.grammar is not None:  # structured output: forbidden tokens to -inf
            logits = apply_grammar_masks(logits, seq_ids, plan.grammar)
        states = [self.seqs[s] for s in seq_ids]
        out = self.sampler(logits, [s.sampling for s in states], [s.token_ids for s in states],
                           [s.num_prompt_tokens for s in states], may_modify=not logits_read_later)
        return StepResult(step_id, seq_ids, out.token_ids, out.logprobs, out.top_logprobs)

    def _verify(self, plan: StepPlan, logits: torch.Tensor, seq_ids: list[int],
                rows: dict[int, int], drafts: dict[int, list[int]]) -> StepResult:
        """A step with drafts: the other rows sample as usual; each sequence with drafts has
        its drafts verified against its rows (workers/sampling/speculative.py) and returns
        the number accepted and the token sampled after them."""
        plain = [s for s in seq_ids if s not in drafts]
        spec = [s for s in seq_ids if s in drafts]
        result = self._sample(plan, logits, plain, [rows[s] for s in plain],
                              logits_read_later=True)
        index = torch.tensor([rows[s] + j for s in spec for j in range(len(drafts[s]) + 1)],
                             device=logits.device)
        states = [self.seqs[s] for s in spec]
        verified = verify_drafts(logits[index], [drafts[s] for s in spec],
                                 [st.sampling.with_defaults() for st in states],
                                 [len(st.token_ids) for st in states], self.sampler.generator)
        tokens = dict(zip(plain, result.token_ids))
        accepted = dict.fromkeys(plain, 0)
        for seq_id, (num, token) in zip(spec, verified):
            tokens[seq_id], accepted[seq_id] = token, num
        out = StepResult(plan.step_id, seq_ids, [tokens[s] for s in seq_ids], None, None,
                         [accepted[s] for s in seq_ids])
        if result.logprobs is not None:  # rows with drafts never ask for logprobs
            lps = dict(zip(plain, result.logprobs))
            out.logprobs = [lps.get(s, float("nan")) for s in seq_ids]
        if result.top_logprobs is not None:
            tops = dict(zip(plain, result.top_logprobs))
            out.top_logprobs = [tops.get(s, []) for s in seq_ids]
        return out

    def _state(self, seq_id: int, what: str) -> SeqState:
        try:
            return self.seqs[seq_id]
        except KeyError:
            raise ValueError(f"{what} sequence {seq_id} is unknown to this worker "
                             "(never sent as NewSeq, or already finished)") from None


def _prompt_chunks(plan: StepPlan, items: list[SeqStep], prompt_rows: dict
                   ) -> list[tuple[int, PromptLogprobs]]:
    """(seq_id, chunk) per scheduled sequence whose rows gave prompt logprobs; the items
    are the decode columns, then plan.scheduled in order."""
    first = len(plan.decode_seq_ids)
    chunks = []
    for index, (logprobs, tops) in sorted(prompt_rows.items()):
        scheduled = plan.scheduled[index - first]
        chunks.append((scheduled.seq_id,
                       PromptLogprobs(items[index].start_pos + 1, logprobs, tops)))
    return chunks


def _first_rows(sampled_ids: list[int], drafts: dict[int, list[int]]) -> dict[int, int]:
    """Each sampling sequence's first logits row: one row each, 1 + its drafts with drafts."""
    if not drafts:
        return {seq_id: row for row, seq_id in enumerate(sampled_ids)}
    rows, row = {}, 0
    for seq_id in sampled_ids:
        rows[seq_id] = row
        row += 1 + len(drafts.get(seq_id, ()))
    return rows


def _mapping(pairs: list[tuple[int, int]], device: torch.device) -> torch.Tensor:
    return torch.tensor(pairs, dtype=torch.int64).view(-1, 2).to(device)
