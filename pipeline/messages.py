"""Every message that crosses a process boundary, declared once, data only.

All types are msgspec Structs encoded with ``msgspec.msgpack`` as plain msgpack maps (field name ->
value), so any msgpack implementation can read and write them. Never pickle.
"""
from __future__ import annotations

from typing import Any

import msgspec

from pagedserve.pipeline.lora_request import LoRARequest
from pagedserve.pipeline.pooling import PoolingParams
from pagedserve.pipeline.sampling_params import SamplingParams

__all__ = ["PromptLogprobs", "NewSeq", "ScheduledSeq", "Fork", "SharedTables", "GrammarMasks", "TierOps", "StepPlan", "StepResult", "AddRequest",
           "Abort", "RequestRejected", "UtilityCall", "UtilityReply", "DetokOpen", "SampleTokens",
           "TokenBatch", "TextDelta", "DeltaBatch", "RequestFailed", "StopMatched", "Hello",
           "HelloAck", "ProcessReady", "ProcessFatal", "WorkerReady", "WorkerFailed", "Shutdown",
           "Reset", "StepTimeout", "RoleDown", "RoleRestarted", "GroupFailed", "Heartbeat",
           "UnknownMessage"]


# ---------------------------------------------------------------------------------------------
# Scheduler <-> workers: the step plan and its result (docs/INTERFACES.md, "pipeline/messages.py")
#
# A plan is a diff against what the workers already hold. Workers apply, in this order:
# finished_seq_ids (drop state), new_seqs (create or replace state), swap_out, swap_in, copy,
# then compute the decode columns and `scheduled` (in that order), then forks.
# ---------------------------------------------------------------------------------------------

class PromptLogprobs(msgspec.Struct, gc=False):
    """Logprobs of prompt tokens start, start + 1, ... (start >= 1: the first prompt token has
    none), each from the model's raw logits at the position before it: the token's own and
    the top-N of that position (SamplingParams.prompt_logprobs; [] each when N is 0)."""

    start: int
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]

    def after(self, num_known: int) -> "PromptLogprobs | None":
        """The part past the first `num_known` prompt tokens (None: nothing new)."""
        skip = max(0, num_known - self.start)
        if skip >= len(self.logprobs):
            return None
        if not skip:
            return self
        return PromptLogprobs(self.start + skip, self.logprobs[skip:], self.top_logprobs[skip:])


class NewSeq(msgspec.Struct, gc=False):
    """A sequence's full state, sent when it is first scheduled or when the workers' copy of it
    must be replaced (recompute after preemption, swap-in, copy-on-write of its last block)."""

    seq_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    table_row: int = -1  # its row in StepPlan.shared_tables, stable until it is freed; -1: none
    # An embedding request's sequence: prefill-only, pooled (not sampled) when it reaches the
    # end of its prompt (pipeline/pooling.py).
    pool: bool = False
    # Its request's LoRA adapter (pipeline/lora_request.py); None: the base model. The workers
    # give it a slot for the steps it computes in (workers/lora/).
    lora: LoRARequest | None = None


class ScheduledSeq(msgspec.Struct, gc=False, omit_defaults=True):
    """What one sequence computes this step: tokens [num_computed, num_computed + num_tokens),
    then its draft tokens, if any (n-gram speculation): rank 0 samples after the last token and
    after each draft, and returns in StepResult.num_accepted how many drafts it accepted."""

    seq_id: int
    num_tokens: int
    new_block_ids: list[int]  # appended to its block table before computing
    new_token_ids: list[int]  # ids the workers have not seen yet (the last sampled token)
    draft_token_ids: list[int] = []
    # Of new_token_ids, the first num_skipped are drafts accepted last step: already computed.
    num_skipped: int = 0


class Fork(msgspec.Struct, gc=False):
    """After this step the children copy the parent's state and sample from its logits."""

    parent_id: int
    child_ids: list[int]
    child_rows: list[int] = msgspec.field(default_factory=list)  # their table rows (if shared)


class SharedTables(msgspec.Struct, frozen=True):
    """The scheduler's block tables in POSIX shared memory (kvmanager.SharedBlockTables):
    int32 [rows, width], row NewSeq.table_row holding that sequence's block ids. Workers on the
    same host attach it read-only and take their block tables from it; a worker that cannot
    attach it uses the block ids of the plans."""

    name: str
    rows: int
    width: int


class GrammarMasks(msgspec.Struct, gc=False):
    """The token masks of a step's constrained samples (pipeline/structured/matchers.py):
    `bitmask` is int32 [len(seq_ids), num_words] in native byte order, bit t of a row set when
    token t is allowed. A fork child sampling from its parent's logits has a row of its own."""

    seq_ids: list[int]
    num_words: int
    bitmask: bytes


class TierOps(msgspec.Struct, gc=False, omit_defaults=True):
    """A step's moves between the device pool and the KV tiers below it (kvmanager/tiers.py),
    applied before the swaps: the stored device blocks are read first (their contents as of
    the step's start), then the loads are written into their device blocks, then the stored
    copies into the host tier's slots and the disk writer's queue."""

    store_blocks: list[int] = []  # device blocks to copy out
    store_slots: list[int] = []  # per stored block: its host-tier slot, -1: none
    store_hashes: list[bytes] = []  # per stored block: its disk file's hash, b"": none ([]: none)
    load_host: list[tuple[int, int]] = []  # (host-tier slot, device block)
    load_disk: list[tuple[bytes, int]] = []  # (block hash, device block)
    delete: list[bytes] = []  # block files evicted from the disk tier


class StepPlan(msgspec.Struct, gc=False):
    step_id: int
    new_seqs: list[NewSeq]
    scheduled: list[ScheduledSeq]
    swap_out: list[tuple[int, int]]  # (gpu_block, cpu_block)
    swap_in: list[tuple[int, int]]  # (cpu_block, gpu_block)
    copy: list[tuple[int, int]]  # (src_block, dst_block), copy-on-write
    forks: list[Fork]
    finished_seq_ids: list[int]  # workers drop their state for these
    shared_tables: SharedTables | None = None
    # Steady decodes, as columns rather than one ScheduledSeq each: every sequence here computes
    # one token, the one it sampled last (sent alongside), and samples. decode_new_blocks
    # holds (index into the columns, block id) for the few that open a new block this step:
    # appended to that sequence's table first. They come before `scheduled` in the batch and
    # in the result's rows.
    decode_seq_ids: list[int] = []
    decode_token_ids: list[int] = []
    decode_new_blocks: list[tuple[int, int]] = []
    grammar: GrammarMasks | None = None  # structured output's masks, when any sample has one
    # Planned before the previous step's result was back (overlapped scheduling): each decode
    # column's token is the one rank 0 sampled for that sequence last step, which the other
    # ranks receive by broadcast (decode_token_ids holds -1s).
    ahead: bool = False
    tiers: TierOps | None = None  # KV tier loads and stores, when any

    def seq_steps(self) -> list[ScheduledSeq]:
        """Every sequence this step computes, in batch order, the decode columns spelled out as
        ScheduledSeq entries (for tests, logs and tools; the hot paths read the columns)."""
        blocks: dict[int, list[int]] = {}
        for index, block in self.decode_new_blocks:
            blocks.setdefault(index, []).append(block)
        return [ScheduledSeq(sid, 1, blocks.get(i, []), [tok]) for i, (sid, tok)
                in enumerate(zip(self.decode_seq_ids, self.decode_token_ids))] + self.scheduled

    @property
    def num_scheduled(self) -> int:
        return len(self.decode_seq_ids) + len(self.scheduled)

    @property
    def num_tokens(self) -> int:
        """Tokens computed this step."""
        return len(self.decode_seq_ids) + sum(s.num_tokens + len(s.draft_token_ids)
                                              for s in self.scheduled)


class StepResult(msgspec.Struct, gc=False, omit_defaults=True):
    """One row per sequence that sampled this step (including fork children)."""

    step_id: int
    seq_ids: list[int]
    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None
    # Per row, the drafts accepted before its token (the sample's new tokens are those drafts
    # and the token); empty when no row had drafts.
    num_accepted: list[int] = []
    # Prompt logprobs computed this step, (seq_id, chunk) for each sequence whose prefill
    # chunk covered prompt positions and asked for them (whether or not it sampled).
    prompt_logprobs: list[tuple[int, PromptLogprobs]] = []
    # PAGEDSERVE_STEP_TRACE only: rank 0's clock readings (time.monotonic(): "received" the
    # plan, "sent" the result) and milliseconds (forward, sample, matmul, attention).
    timings: dict[str, float] = {}
    # Pooling sequences that completed their prompt this step (no row above), and each one's
    # vector as little-endian float32 bytes (pipeline/pooling.py).
    pooled_seq_ids: list[int] = []
    pooled: list[bytes] = []
    # KV tier blocks whose disk store or load failed since the last result (a full disk, an
    # I/O error, a corrupt or missing file): no longer on disk. A failed load was recomputed.
    tier_failed: list[bytes] = []


# ---------------------------------------------------------------------------------------------
# Client <-> scheduler (the scheduler's ROUTER; clients are DEALERs with their own identity)
# ---------------------------------------------------------------------------------------------
class AddRequest(msgspec.Struct, kw_only=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    # Resubmission after a scheduler restart: tokens the client already has, per sample index,
    # and the text length it has already shown for each.
    output_token_ids: list[list[int]] = []
    text_offsets: list[int] = []
    # Sent again by a client that could not tell whether this scheduler has it (its socket
    # reconnected to a restarted one): a scheduler that holds it from this client ignores it.
    resubmitted: bool = False
    # An embedding request: prefill-only, answered with its pooled vector (no tokens).
    pooling: PoolingParams | None = None
    # The LoRA adapter it runs with (the ingress resolved its model name); None: the base model.
    lora: LoRARequest | None = None


class Abort(msgspec.Struct):
    request_ids: list[str]


class RequestRejected(msgspec.Struct):
    """The scheduler refused a request: status 400 (can never run) or 503 (overloaded/draining)."""
    request_id: str
    status: int
    message: str


class UtilityCall(msgspec.Struct):
    call_id: int
    method: str  # "stats" | "health"


class UtilityReply(msgspec.Struct):
    call_id: int
    result: dict[str, Any] | None = None
    error: str | None = None


# ---------------------------------------------------------------------------------------------
# Scheduler -> detokenizer -> client
# ---------------------------------------------------------------------------------------------
class DetokOpen(msgspec.Struct, kw_only=True):
    """A request the scheduler accepted: the detokenizer prepares its per-sample state."""
    request_id: str
    client_id: bytes
    prompt_token_ids: list[int]
    sampling: SamplingParams
    text_offsets: list[int] = []


class SampleTokens(msgspec.Struct, kw_only=True):
    """New tokens of one sample (index < n) of one request."""
    request_id: str
    index: int
    token_ids: list[int]
    offset: int = 0  # position of token_ids[0] in the sample's output (re-feeds repeat ids)
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    embedding: bytes | None = None  # a pooling request's vector (little-endian float32)


class TokenBatch(msgspec.Struct):
    step_id: int
    samples: list[SampleTokens]
    # One new token for each of many samples, as columns (a step's plain decodes: no finish,
    # no logprobs): sample index indices[i] of request request_ids[i] gained token_ids[i], its
    # output token number offsets[i]. Read before `samples`.
    request_ids: list[str] = []
    indices: list[int] = []
    token_ids: list[int] = []
    offsets: list[int] = []
    # (request id, chunk): prompt logprobs computed this step; sample 0 passes them on.
    prompt_logprobs: list[tuple[str, PromptLogprobs]] = []
    sent: float = 0.0  # PAGEDSERVE_STEP_TRACE only: the scheduler's time.monotonic() at send

    def all_samples(self) -> list[SampleTokens]:
        """The columns spelled out as SampleTokens, then `samples`."""
        return [SampleTokens(request_id=rid, index=i, token_ids=[t], offset=o) for rid, i, t, o
                in zip(self.request_ids, self.indices, self.token_ids, self.offsets)] + self.samples


class TextDelta(msgspec.Struct, kw_only=True):
    """New output of one sample. The offsets say where `token_ids` and `text` start in the
    sample's whole output, so a client drops what it already has when a stream is re-fed after
    a restart: every stream is idempotent."""
    request_id: str
    index: int
    text: str
    token_ids: list[int]
    token_offset: int = 0
    text_offset: int = 0
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: PromptLogprobs | None = None  # sample 0 only; its own offset (start)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # so far, this sample
    num_cached_tokens: int = 0
    embedding: bytes | None = None  # a pooling request's vector (little-endian float32)


class DeltaBatch(msgspec.Struct):
    deltas: list[TextDelta]


class RequestFailed(msgspec.Struct):
    """Sent to a client when its request cannot complete (a process died, shutdown)."""
    request_id: str
    status: int
    message: str


class StopMatched(msgspec.Struct):
    """The detokenizer found a stop string: the scheduler finishes that sample."""
    request_id: str
    index: int
    stop: str


class Hello(msgspec.Struct):
    """A client announces itself to the detokenizer's ROUTER before submitting anything."""
    client_id: bytes


class HelloAck(msgspec.Struct):
    client_id: bytes


# ---------------------------------------------------------------------------------------------
# Lifecycle (any role -> launcher; scheduler -> workers/detokenizer)
# ---------------------------------------------------------------------------------------------
class ProcessReady(msgspec.Struct):
    role: str
    rank: int
    pid: int
    detail: str = ""


class ProcessFatal(msgspec.Struct):
    role: str
    rank: int
    pid: int
    message: str


class WorkerReady(msgspec.Struct):
    """A rank is built (token "") or has applied Reset(token) and holds no sequence state."""
    rank: int
    pid: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    token: str = ""
    # The KV tiers below the device pool (--kv-offload-*): host-tier blocks, the bytes of one
    # block, and the namespace of the disk tier's files (b"": no disk tier).
    num_tier_blocks: int = 0
    block_bytes: int = 0
    tier_namespace: bytes = b""


class Reset(msgspec.Struct):
    """Scheduler -> workers and detokenizer: drop every sequence/request state. Workers answer
    WorkerReady(token); a Reset whose token was already applied is ignored (it is resent until
    answered)."""
    token: str


class StepTimeout(msgspec.Struct):
    """Scheduler -> launcher: a step ran past --step-timeout; the worker group is hung."""
    step_id: int
    seconds: float


class RoleDown(msgspec.Struct):
    """Launcher -> scheduler: a role died and is being restarted (health turns 503).
    `attributable`: it died of itself (an exception, a crash signal, an error exit) - or, for
    the detokenizer and ingress, hung while its breadcrumb named `suspect` - so what it was
    computing may be the cause; not when it was killed from outside."""
    role: str
    cause: str
    attributable: bool = False
    suspect: str = ""  # detokenizer, ingress: the request its breadcrumb named (quarantined)


class RoleRestarted(msgspec.Struct):
    """Launcher -> scheduler: a restarted role is ready again."""
    role: str


class GroupFailed(msgspec.Struct):
    """Launcher -> scheduler and detokenizer: giving up; fail every request with this cause."""
    role: str
    message: str


class WorkerFailed(msgspec.Struct):
    rank: int
    step_id: int
    message: str


class Shutdown(msgspec.Struct):
    reason: str = ""


class Heartbeat(msgspec.Struct):
    """Scheduler/detokenizer -> launcher, about once a second from their loops."""
    role: str
    pid: int


class UnknownMessage(msgspec.Struct):
    """Any role -> scheduler: it received a message it does not handle (or could not decode).
    The scheduler counts these by role and type; /metrics exports the counts."""
    role: str
    tag: str
    reason: str
