"""Admission control: refuse at `add` what could never run, or what the queue cannot hold."""
from __future__ import annotations

from pagedserve.kvmanager.window import max_blocks_per_step
from pagedserve.pipeline.lora_request import LORA_SALT_PREFIX, lora_cache_salt
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
    _check_lora(rid, request, config)
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
    num_prompt = len(prompt)
    if request.pooling is not None:
        max_output = _pooling_limits(rid, num_prompt, outputs, sampling.n, config)
    elif config.encoder_only:
        raise RequestRejected(rid, "this model is an encoder: it serves embeddings "
                                   "(/v1/embeddings), not generation")
    else:
        max_output = _generation_limits(rid, num_prompt, sampling.max_tokens,
                                        config.max_model_len)
        if len(outputs) >= max_output:
            raise RequestRejected(rid, f"{len(outputs)} tokens already generated, max_tokens "
                                       f"is {max_output}: nothing left to generate")
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
    return RequestState(rid, sampling, request.arrival_time, request.priority,
                        lora_cache_salt(request.lora, request.cache_salt), num_prompt, max_output,
                        _shared(frozenset(stop_ids)), request.pooling, request.lora)


def _check_lora(rid: str, request: Request, config: SchedulerConfig) -> None:
    """An adapter only with LoRA on, and no client salt that poses as an adapter's."""
    if request.cache_salt is not None and request.cache_salt.startswith(LORA_SALT_PREFIX):
        raise RequestRejected(rid, "cache_salt may not start with a NUL character")
    if request.lora is not None and not config.max_loras:
        raise RequestRejected(rid, f"LoRA adapter {request.lora.lora_name!r} asked for, but LoRA "
                                   f"is disabled (start the server with --enable-lora)")
    if request.lora is not None and request.pooling is not None:
        raise RequestRejected(rid, "embeddings run on the base model only, not a LoRA adapter")


def _generation_limits(rid: str, num_prompt: int, max_tokens: int | None, max_len: int) -> int:
    """The request's max_output_tokens: max_tokens, or what the context leaves."""
    if max_tokens is None:
        if num_prompt >= max_len:
            raise RequestRejected(rid, f"prompt has {num_prompt} tokens but max_model_len is "
                                       f"{max_len}, leaving no room to generate")
        return max_len - num_prompt
    if num_prompt + max_tokens > max_len:
        raise RequestRejected(
            rid, f"prompt has {num_prompt} tokens and max_tokens is {max_tokens}, together "
                 f"{num_prompt + max_tokens}, but max_model_len is {max_len}")
    return max_tokens


def _pooling_limits(rid: str, num_prompt: int, outputs: list[int], n: int,
                    config: SchedulerConfig) -> int:
    """An embedding request generates nothing (max_output_tokens 0); its prompt must fit the
    context and, when the pooling reads every token at once, one step's token budget."""
    if outputs or n != 1:
        raise RequestRejected(rid, "an embedding request has one sample and no output tokens")
    if num_prompt > config.max_model_len:
        raise RequestRejected(rid, f"input has {num_prompt} tokens but max_model_len is "
                                   f"{config.max_model_len}")
    if config.pooling_whole_prompt and num_prompt > config.max_num_batched_tokens:
        raise RequestRejected(rid, f"input has {num_prompt} tokens but this model pools the "
                                   f"whole input in one step, of at most "
                                   f"{config.max_num_batched_tokens} tokens "
                                   f"(--max-num-batched-tokens)")
    return 0


_stop_sets: dict[frozenset[int], frozenset[int]] = {}


def _shared(stop_ids: frozenset[int]) -> frozenset[int]:
    """One set per distinct content: `update` checks every sampled token against its request's
    set, and a few shared sets stay in cache where thousands of equal copies would not."""
    if len(_stop_sets) < 1024:
        return _stop_sets.setdefault(stop_ids, stop_ids)
    return _stop_sets.get(stop_ids, stop_ids)
