"""Per-request sampling parameters, shared by the API, the scheduler, the wire and the sampler."""
from __future__ import annotations

import math
from collections.abc import Mapping

import msgspec

from pagedserve.pipeline.structured.spec import StructuredOutputs

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Limits on what one request may make the engine do: each field below multiplies some work (the
# samples, the vocabulary rows sorted for logprobs, the detokenizer's stop matching), so each has
# a bound a normal client does not reach, named in the error that refuses more.
MAX_N = 128                   # samples of one request; the ingress also caps it by max_num_seqs
MAX_LOGPROBS = 20             # OpenAI's top_logprobs limit
MAX_LOGIT_BIAS = 100.0        # OpenAI's range for a bias value
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_STOP_STRINGS = 16         # OpenAI allows 4
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256

# Fields a request may leave unset (None) for the model's default (pipeline/generation_defaults.py),
# with the value they take when the model has none.
NEUTRAL_VALUES = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                  "repetition_penalty": 1.0}
MODEL_DEFAULT_FIELDS = tuple(NEUTRAL_VALUES)


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What to generate and how; `validate()` raises ValueError naming the bad field.

    temperature, top_p, top_k, min_p and repetition_penalty left None take the model's defaults
    (its generation_config.json) at the scheduler's admission, else NEUTRAL_VALUES
    (`with_defaults`); the sampler only ever sees numbers.
    """

    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # -1 (or 0 on input) disables
    min_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    seed: int | None = None
    max_tokens: int | None = 16  # None = up to the max model length
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    # token id -> added to its logit before sampling (OpenAI's logit_bias, -100..100)
    logit_bias: dict[int, float] = {}
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs besides the chosen token's
    # vLLM's prompt_logprobs: per prompt token after the first, its logprob and the top-N
    # (computed in the prefill; such a request reads no blocks from the prefix cache)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Constrain the output to a JSON schema, regex, choice or grammar (pipeline/structured/).
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        if self.top_k == 0:
            self.top_k = -1
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    def for_sample(self, index: int) -> "SamplingParams":
        """The params of sample `index` of an n > 1 request (sample 0 is the request's own).

        A seeded row's randomness depends on (seed, length) only, so the samples must not share
        a seed or they would draw the same tokens: each gets one derived from it, which keeps the
        whole request reproducible (and lets a recomputed sample continue exactly).
        """
        if self.seed is None or index == 0:
            return self
        mixed = (self.seed + index * 0x9E3779B97F4A7C15) % (1 << 64)
        return msgspec.structs.replace(self, seed=mixed - (1 << 64) if mixed >= 1 << 63 else mixed)

    def with_defaults(self, defaults: Mapping[str, float] | None = None) -> "SamplingParams":
        """These params with every unset field filled: from `defaults` (the model's), else
        its neutral value. Fields already set are kept; self when nothing is unset."""
        if not (self.temperature is None or self.top_p is None or self.top_k is None
                or self.min_p is None or self.repetition_penalty is None):
            return self
        defaults = defaults or {}
        filled = {name: defaults.get(name, neutral) for name, neutral in NEUTRAL_VALUES.items()
                  if getattr(self, name) is None}
        return msgspec.structs.replace(self, **filled)

    @property
    def greedy(self) -> bool:
        return (self.temperature is not None and self.temperature < 1e-5) or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty not in (None, 1.0))

    def validate(self, *, vocab_size: int | None = None, max_n: int = MAX_N,
                 check_structured: bool = True) -> "SamplingParams":
        """The one gate of every entry point (HTTP, the Python API, the engine client, the
        scheduler's admission): ValueError naming the field, its value and the limit.

        `check_structured`: parse structured_outputs (milliseconds; the scheduler, which
        compiles it off its loop anyway, skips this, but not the size check)."""
        _check_numbers(self, max_n)
        _check_stops(self, vocab_size)
        _check_logit_bias(self, vocab_size)
        if self.structured_outputs is not None:
            if check_structured:
                self.structured_outputs.check()
            else:
                self.structured_outputs.check_size()
        return self


def check_count(field: str, count: int, limit: int, unit: str) -> None:
    """Refuse `count` items of a field over its `limit`, in the words every limit uses."""
    if count > limit:
        raise ValueError(f"{field} has {count} {unit} but at most {limit} are allowed")


def _check_numbers(p: SamplingParams, max_n: int) -> None:
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        v = getattr(p, name)
        if v is None and name in NEUTRAL_VALUES:
            continue
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise ValueError(f"{name} must be a finite number, got {v!r}")
    if not 1 <= p.n <= max_n:
        raise ValueError(f"n must be between 1 and {max_n}, got {p.n}")
    _check_ranges(p.with_defaults())
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(p, name)
        if not -2.0 <= v <= 2.0:
            raise ValueError(f"{name} must be in [-2, 2], got {v}")
    if p.seed is not None and not INT64_MIN <= p.seed <= INT64_MAX:
        raise ValueError(f"seed must fit in a signed 64-bit integer, got {p.seed}")
    if p.max_tokens is not None and p.max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {p.max_tokens}")
    if p.min_tokens < 0:
        raise ValueError(f"min_tokens must be >= 0, got {p.min_tokens}")
    if p.max_tokens is not None and p.min_tokens > p.max_tokens:
        raise ValueError(f"min_tokens ({p.min_tokens}) must not exceed max_tokens "
                         f"({p.max_tokens})")
    if p.logprobs is not None and not 0 <= p.logprobs <= MAX_LOGPROBS:
        raise ValueError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {p.logprobs}")
    if p.prompt_logprobs is not None and not 0 <= p.prompt_logprobs <= MAX_LOGPROBS:
        raise ValueError(f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}, got "
                         f"{p.prompt_logprobs}")


def _check_stops(p: SamplingParams, vocab_size: int | None) -> None:
    check_count("stop", len(p.stop), MAX_STOP_STRINGS, "strings")
    for i, stop in enumerate(p.stop):
        if not isinstance(stop, str) or not stop:
            raise ValueError("stop entries must be non-empty strings")
        if len(stop) > MAX_STOP_STRING_CHARS:
            raise ValueError(f"stop[{i}] has {len(stop)} characters but at most "
                             f"{MAX_STOP_STRING_CHARS} are allowed")
    check_count("stop_token_ids", len(p.stop_token_ids), MAX_STOP_TOKEN_IDS, "token ids")
    for t in p.stop_token_ids:
        _check_token_id("stop_token_ids", t, vocab_size)


def _check_logit_bias(p: SamplingParams, vocab_size: int | None) -> None:
    check_count("logit_bias", len(p.logit_bias), MAX_LOGIT_BIAS_ENTRIES, "entries")
    for t, v in p.logit_bias.items():
        _check_token_id("logit_bias", t, vocab_size)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) \
                or not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias value for token {t} must be a number in "
                             f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {v!r}")


def _check_ranges(p: SamplingParams) -> None:
    """The ranges of the fields a model may default (checked on the filled-in values)."""
    if not 0.0 <= p.temperature <= 2.0:
        raise ValueError(f"temperature must be in [0, 2], got {p.temperature}")
    if not 0.0 < p.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {p.top_p}")
    if p.top_k < -1 or p.top_k == 0:
        raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {p.top_k}")
    if not 0.0 <= p.min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {p.min_p}")
    if not 0.0 < p.repetition_penalty <= 2.0:
        raise ValueError(f"repetition_penalty must be in (0, 2], got {p.repetition_penalty}")


def _check_token_id(field: str, token: object, vocab_size: int | None) -> None:
    if not isinstance(token, int) or isinstance(token, bool) or token < 0:
        raise ValueError(f"{field} contains {token!r}, which is not a token id (an integer >= 0)")
    if vocab_size is not None and token >= vocab_size:
        raise ValueError(f"{field} contains {token}, outside the vocabulary [0, {vocab_size})")
