"""Every message that crosses a process boundary, declared once, data only.

All types are msgspec Structs encoded with ``msgspec.msgpack`` as plain msgpack maps (field name ->
value), so any msgpack implementation can read and write them. Never pickle.
"""
from __future__ import annotations

import msgspec

from pipeline.sampling_params import SamplingParams

__all__ = ["NewSeq", "ScheduledSeq", "Fork", "StepPlan", "StepResult"]


# ---------------------------------------------------------------------------------------------
# Scheduler <-> workers: the step plan and its result (docs/INTERFACES.md, "pipeline/messages.py")
#
# A plan is a diff against what the workers already hold. Workers apply, in this order:
# finished_seq_ids (drop state), new_seqs (create or replace state), swap_out, swap_in, copy,
# then compute `scheduled`, then forks.
# ---------------------------------------------------------------------------------------------

class NewSeq(msgspec.Struct, gc=False):
    """A sequence's full state, sent when it is first scheduled or when the workers' copy of it
    must be replaced (recompute after preemption, swap-in, copy-on-write of its last block)."""

    seq_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


class ScheduledSeq(msgspec.Struct, gc=False):
    """What one sequence computes this step: tokens [num_computed, num_computed + num_tokens)."""

    seq_id: int
    num_tokens: int
    new_block_ids: list[int]  # appended to its block table before computing
    new_token_ids: list[int]  # ids the workers have not seen yet (the last sampled token)


class Fork(msgspec.Struct, gc=False):
    """After this step the children copy the parent's state and sample from its logits."""

    parent_id: int
    child_ids: list[int]


class StepPlan(msgspec.Struct, gc=False):
    step_id: int
    new_seqs: list[NewSeq]
    scheduled: list[ScheduledSeq]
    swap_out: list[tuple[int, int]]  # (gpu_block, cpu_block)
    swap_in: list[tuple[int, int]]  # (cpu_block, gpu_block)
    copy: list[tuple[int, int]]  # (src_block, dst_block), copy-on-write
    forks: list[Fork]
    finished_seq_ids: list[int]  # workers drop their state for these


class StepResult(msgspec.Struct, gc=False):
    """One row per sequence that sampled this step (including fork children)."""

    step_id: int
    seq_ids: list[int]
    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None
