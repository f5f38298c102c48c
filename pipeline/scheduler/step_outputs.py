"""What the Scheduler hands back: from `update` (and an abort or stop) one SequenceOutput per
sample that gained tokens or finished, the plain ones kept as columns (`StepOutputs`); from
`stats` its counts (`SchedulerStats`); from `reset_device_state` what it did (`Recovery`)."""
from __future__ import annotations

from collections.abc import Sequence as CollectionSequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from pagedserve.pipeline.messages import PromptLogprobs
    from pagedserve.pipeline.scheduler.sequence import Sequence


class SequenceOutput(msgspec.Struct, gc=False):
    """What one step (or an abort/stop) produced for one sample of a request."""

    request_id: str
    index: int  # sample index, 0 .. n-1
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" once this sample is done
    request_finished: bool = False  # every sample of the request is done
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    offset: int = 0  # position of new_token_ids[0] among the sample's output tokens
    embedding: bytes | None = None  # a pooling request's vector


class StepOutputs(CollectionSequence):
    """What `Scheduler.update` returns for one step (docs/INTERFACES.md): a SequenceOutput per
    sample that gained a token, the plain ones (nearly all) kept as columns, which the scheduler
    process forwards without building an object per sample; indexing builds them on demand."""

    __slots__ = ("seqs", "token_ids", "others", "prompt_logprobs")

    def __init__(self, seqs: list[Sequence], token_ids: list[int],
                 others: list[SequenceOutput]) -> None:
        self.seqs = seqs
        self.token_ids = token_ids
        self.others = others
        # (request id, chunk): prompt logprobs new this step (not counted in len())
        self.prompt_logprobs: list[tuple[str, PromptLogprobs]] = []

    def __len__(self) -> int:
        return len(self.seqs) + len(self.others)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(len(self))[i]]
        i = range(len(self))[i]  # a negative index counts from the end; IndexError past it
        n = len(self.seqs)
        if i >= n:
            return self.others[i - n]
        seq = self.seqs[i]
        return SequenceOutput(seq.request.request_id, seq.index, [self.token_ids[i]],
                              offset=len(seq.token_ids) - seq.num_prompt_tokens - 1)

    def __eq__(self, other) -> bool:
        if isinstance(other, (StepOutputs, list, tuple)):
            return list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"StepOutputs({list(self)!r})"


@dataclass(slots=True)
class Recovery:
    """What `reset_device_state` did (docs/INTERFACES.md)."""
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
