"""N-gram speculative decoding on the scheduler's side: settings and the proposer.

A speculating sequence in steady decode proposes up to k tokens from its own context (prompt
lookup): the longest suffix of its tokens, n from prompt_lookup_max down to prompt_lookup_min,
that occurred earlier is looked up, and the tokens that followed its latest earlier occurrence
are the drafts. The workers compute the last token and the drafts in one forward, rank 0
verifies them (workers/sampling/speculative.py: exact for greedy, rejection sampling for sampled
requests) and returns how many it accepted; the scheduler appends those and the token sampled
after them (bookkeeping.py: `update`; results.py).

The lookup is an index per sequence, kept up to date as tokens are appended: each n-gram that
has a token after it maps to where its latest occurrence ends, so a proposal costs a few dict
operations per new token, not a scan of the context.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

METHODS = ("ngram",)
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
         "disable_by_batch_size")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """vLLM's `--speculative-config` names. `disable_by_batch_size`: no drafts in a step whose
    running batch is larger (speculation pays for one user, not for a full batch); 0: never."""

    method: str = "ngram"
    num_speculative_tokens: int = 0
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    disable_by_batch_size: int = 0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"--speculative-config: method must be one of {', '.join(METHODS)} "
                             f"(no draft models here), got {self.method!r}")
        for name in _KEYS[1:]:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"--speculative-config: {name} must be an integer >= 0, "
                                 f"got {value!r}")
        if not 1 <= self.num_speculative_tokens <= 32:
            raise ValueError(f"--speculative-config: num_speculative_tokens must be in 1..32, "
                             f"got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"--speculative-config: need 1 <= prompt_lookup_min "
                             f"({self.prompt_lookup_min}) <= prompt_lookup_max "
                             f"({self.prompt_lookup_max})")

    @classmethod
    def parse(cls, value: str | dict | None) -> SpeculativeConfig | None:
        """A JSON object (the command line) or a dict; None or {} is no speculation. As in
        vLLM, a missing prompt_lookup_min or _max takes the other's value, both missing 5."""
        if value is None or value == "" or value == {}:
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--speculative-config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"--speculative-config must be a JSON object, got {value!r}")
        unknown = sorted(set(value) - set(_KEYS))
        if unknown:
            raise ValueError(f"--speculative-config: unknown key(s) {', '.join(unknown)} "
                             f"(known: {', '.join(_KEYS)})")
        if "num_speculative_tokens" not in value:
            raise ValueError("--speculative-config: num_speculative_tokens is required")
        low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        low, high = (low if low is not None else high or 5), (high if high is not None else low or 5)
        return cls(**{**value, "prompt_lookup_min": low, "prompt_lookup_max": high})


class NgramIndex:
    """One sequence's n-grams (n in [low, high]) that have a token after them -> the end of
    their latest occurrence. `ended` counts the end positions indexed so far."""

    __slots__ = ("ends", "ended")

    def __init__(self) -> None:
        self.ends: dict[tuple[int, ...], int] = {}
        self.ended = 0

    def propose(self, tokens: list[int], k: int, low: int, high: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix of
        `tokens` (n from high down to low) seen before; [] when none recurs."""
        size = len(tokens)
        ends = self.ends
        for end in range(max(self.ended, low), size):  # n-grams ending before the last token
            for n in range(low, min(high, end) + 1):
                ends[tuple(tokens[end - n:end])] = end
        self.ended = max(self.ended, size)
        for n in range(min(high, size), low - 1, -1):
            end = ends.get(tuple(tokens[size - n:]))
            if end is not None:
                return tokens[end:end + k]
        return []


class NgramProposer:
    """Drafts for the scheduler's sequences, one index each (dropped when it finishes)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.indexes: dict[int, NgramIndex] = {}

    def propose(self, seq_id: int, tokens: list[int], k: int) -> list[int]:
        index = self.indexes.get(seq_id)
        if index is None:
            index = self.indexes[seq_id] = NgramIndex()
        c = self.config
        return index.propose(tokens, k, c.prompt_lookup_min, c.prompt_lookup_max)

    def forget(self, seq_id: int) -> None:
        self.indexes.pop(seq_id, None)
