"""Admission control: refuse at `add` what could never run, or what the queue cannot hold."""
from __future__ import annotations

from pagedserve.kvmanager.window import max_blocks_per_step
from pagedserve.pipeline.scheduler.config import SchedulerConfig
from pagedserve.pipeline.scheduler.sequence import Request, RequestState


class RequestRejected(ValueError):
    """The request can never be served as asked (HTTP 400); the message names the numbers."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"request {request_id!r} rejected: {reason}")
        self.request_id = request_id
        self.reason = reason


class QueueFull(RequestRejected):
    """The waiting queue is at --max-queued-requests; retry later (HTTP 503 with Retry-After)."""


def _check_token_ids(rid: str, what: str, ids, vocab_size: int | None) -> None:
    """Every id an integer inside the vocabulary: an id outside it would take a worker down
    (the embedding's index error) on every restart."""
    limit = vocab_size if vocab_size is not None else 1 << 62
    for i, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < limit:
            where = f"outside the vocabulary [0, {vocab_size})" if vocab_size is not None \
                and isinstance(t, int) and not isinstance(t, bool) and t >= 0 else \
                "not a token id (an integer >= 0)"
            raise RequestRejected(rid, f"{what}[{i}] is {t!r}, {where}")


def admit_request(request: Request, config: SchedulerConfig, *, num_gpu_blocks: int,
                  num_watermark_blocks: int, eos_token_ids: frozenset[int],
                  num_queued: int) -> RequestState:
    """Check one request against the limits and build its state; raises RequestRejected."""
    rid = request.request_id
    prompt, outputs, sampling = request.prompt_token_ids, request.output_token_ids, request.sampling
    if not isinstance(rid, str) or not rid:
        raise RequestRejected(str(rid), "request_id must be a non-empty string")
    if not prompt:
        raise RequestRejected(rid, "prompt has no tokens")
    _check_token_ids(rid, "prompt_token_ids", prompt, config.vocab_size)
    _check_token_ids(rid, "output_token_ids", outputs, config.vocab_size)
    try:
        sampling.validate(vocab_size=config.vocab_size, check_structured=False)
    except ValueError as exc:
        raise RequestRejected(rid, str(exc)) from None
    # the one gate every entry point passes: unset sampling fields take the model's defaults
    sampling = sampling.with_defaults(config.generation_defaults)
    if outputs and sampling.n != 1:
        raise RequestRejected(rid, f"already generated tokens can only be resubmitted with n=1, "
                                   f"got n={sampling.n}")
    if sampling.n > config.max_num_seqs:
        raise RequestRejected(rid, f"n={sampling.n} samples can never run together: "
                                   f"max_num_seqs is {config.max_num_seqs}")
    num_prompt, max_len = len(prompt), config.max_model_len
    if sampling.max_tokens is None:
        if num_prompt >= max_len:
            raise RequestRejected(rid, f"prompt has {num_prompt} tokens but max_model_len is "
                                       f"{max_len}, leaving no room to generate")
        max_output = max_len - num_prompt
    else:
        max_output = sampling.max_tokens
        if num_prompt + max_output > max_len:
            raise RequestRejected(
                rid, f"prompt has {num_prompt} tokens and max_tokens is {max_output}, together "
                     f"{num_prompt + max_output}, but max_model_len is {max_len}")
    if len(outputs) >= max_output:
        raise RequestRejected(rid, f"{len(outputs)} tokens already generated, max_tokens is "
                                   f"{max_output}: nothing left to generate")
    # A sequence must be able to run alone: all its tokens in the pool minus the admission
    # watermark (n > 1 samples share the prompt and can take turns through preemption); under
    # a sliding window, only its window and one step's chunk.
    bs, window = config.block_size, config.sliding_window
    total = num_prompt + max_output
    max_chunk = min(total, config.max_num_batched_tokens) if config.enable_chunked_prefill \
        else total
    blocks_needed = max_blocks_per_step(total, max_chunk, window, bs)
    usable = num_gpu_blocks - num_watermark_blocks
    if blocks_needed > usable:
        within = f" (a sliding window of {window} and chunks of up to {max_chunk})" \
            if window and blocks_needed < -(-total // bs) else ""
        raise RequestRejected(
            rid, f"prompt ({num_prompt}) + max_tokens ({max_output}) needs {blocks_needed} blocks "
                 f"of {bs} tokens{within} but the KV cache has only {usable} usable blocks "
                 f"({num_gpu_blocks} minus {num_watermark_blocks} kept free by the watermark)")
    if num_queued >= config.max_queued_requests:
        raise QueueFull(rid, f"waiting queue is full: {num_queued} requests queued, "
                             f"max_queued_requests is {config.max_queued_requests}")
    stop_ids = set(sampling.stop_token_ids)
    if not sampling.ignore_eos:
        stop_ids |= eos_token_ids
    return RequestState(rid, sampling, request.arrival_time, request.priority, request.cache_salt,
                        num_prompt, max_output, _shared(frozenset(stop_ids)))


_stop_sets: dict[frozenset[int], frozenset[int]] = {}


def _shared(stop_ids: frozenset[int]) -> frozenset[int]:
    """One set per distinct content: `update` checks every sampled token against its request's
    set, and a few shared sets stay in cache where thousands of equal copies would not."""
    shared = _stop_sets.get(stop_ids)
    if shared is None:
        shared = stop_ids
        if len(_stop_sets) < 1024:
            _stop_sets[stop_ids] = stop_ids
    return shared
