"""`--speculative-config`: the n-gram speculation settings, part of the engine's config.

A contract, not scheduler code: the launcher checks it (pipeline/config.py) and the scheduler's
proposer acts on it (pipeline/scheduler/speculative.py), so it lives with the config and imports
nothing of the roles: a process that reads the config loads no scheduler module.
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
