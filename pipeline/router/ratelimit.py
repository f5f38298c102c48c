"""Per-API-key rate limits: a token bucket for requests and one for tokens per minute.

Pure: the clock is an argument. A bucket holds at most `burst_seconds` worth of its rate and
refills continuously; a request is admitted when both buckets hold what it costs, else the
answer is how long until they will (HTTP 429 with Retry-After).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


class TokenBucket:
    def __init__(self, per_minute: float, *, burst_seconds: float, now: float):
        if per_minute <= 0:
            raise ValueError(f"a rate limit must be positive, got {per_minute} per minute")
        self.rate = per_minute / 60.0
        self.capacity = max(1.0, self.rate * burst_seconds)
        self.level = self.capacity
        self.stamp = now

    def _refill(self, now: float) -> None:
        if now > self.stamp:
            self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
            self.stamp = now

    def wait_for(self, amount: float, now: float) -> float:
        """Seconds until `amount` is available (0: now). An amount above the capacity is
        asked for as the capacity, so that a large request is slow, never refused forever."""
        self._refill(now)
        need = min(amount, self.capacity) - self.level
        return 0.0 if need <= 0 else need / self.rate

    def available(self, now: float) -> float:
        self._refill(now)
        return self.level

    def take(self, amount: float, now: float) -> None:
        """Take `amount` (the level may go below zero: the debt delays later requests)."""
        self._refill(now)
        self.level -= amount

    def give_back(self, amount: float) -> None:
        self.level = min(self.capacity, self.level + amount)


@dataclass(frozen=True, slots=True)
class KeyLimit:
    requests_per_minute: float | None = None
    tokens_per_minute: float | None = None
    priority_floor: int = 0  # the most urgent priority the key may ask for (priority.py)


@dataclass(slots=True)
class _KeyState:
    requests: TokenBucket | None
    tokens: TokenBucket | None


@dataclass(slots=True)
class RateLimiter:
    """The limits of every key; keys without a limit are never limited."""
    limits: dict[str, KeyLimit]
    burst_seconds: float = 60.0
    _state: dict[str, _KeyState] = field(default_factory=dict)

    def _buckets(self, key: str, now: float) -> _KeyState | None:
        limit = self.limits.get(key)
        if limit is None:
            return None
        state = self._state.get(key)
        if state is None:
            def bucket(rate):
                return None if rate is None else TokenBucket(rate, burst_seconds=self.burst_seconds,
                                                             now=now)
            state = self._state[key] = _KeyState(bucket(limit.requests_per_minute),
                                                 bucket(limit.tokens_per_minute))
        return state

    def admit(self, key: str, tokens: int, now: float) -> float:
        """0 and the request is charged (one request, `tokens` tokens); else the seconds to
        wait before it would be admitted (nothing is charged)."""
        state = self._buckets(key, now)
        if state is None:
            return 0.0
        wait = max(state.requests.wait_for(1, now) if state.requests else 0.0,
                   state.tokens.wait_for(tokens, now) if state.tokens else 0.0)
        if wait > 0:
            return wait
        if state.requests:
            state.requests.take(1, now)
        if state.tokens:
            state.tokens.take(tokens, now)
        return 0.0

    def tokens_left(self, key: str, now: float) -> float | None:
        """What the key's token bucket holds now (below 0: a debt); None without a limit."""
        state = self._buckets(key, now)
        if state is None or state.tokens is None:
            return None
        return state.tokens.available(now)

    def settle(self, key: str, charged: int, used: int, now: float) -> None:
        """Correct a request's token charge once its real count is known."""
        state = self._buckets(key, now)
        if state is None or state.tokens is None or used == charged:
            return
        if used > charged:
            state.tokens.take(used - charged, now)
        else:
            state.tokens.give_back(charged - used)


def retry_after_header(seconds: float) -> str:
    """Retry-After is whole seconds; never 0 for a refusal."""
    return str(max(1, math.ceil(seconds)))
