"""Preemption: which running sequence to push out, and whether to swap or recompute it.

The victim is the running sequence with the largest policy key not yet planned this step
(`SequenceQueues.victim`); `RequestLifecycle.preempt` moves it out.

Swap or recompute, by a cost model (seconds to get a preempted sequence of T tokens back):

    swap(T)      = c + 2 * T * kv_bytes_per_token / host_bytes_per_s
                   (its K/V over the host link and back, plus a fixed cost c per round trip)
    recompute(T) = (T * flops_per_token + attn_flops_per_token_pair * T**2) / device_flops_per_s
                   (a prefill of T tokens: causal attention makes it quadratic in T)

Recompute has no fixed cost and grows quadratically, so short sequences are cheaper to
recompute and long ones to swap; the break-even is the positive root of q T^2 + (b - a) T - c
= 0 (a, b the per-token swap and recompute costs, q the quadratic one). With the defaults below
(SmolLM2-135M in fp16, a 25 GB/s host link, ~100 TFLOP/s, 200 us per swap round trip) it is
about 210 tokens. ``SchedulerConfig.swap_threshold_tokens`` overrides it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

SWAP = "swap"
RECOMPUTE = "recompute"


@dataclass(frozen=True, slots=True)
class PreemptionCostModel:
    kv_bytes_per_token: float = 2 * 30 * 3 * 64 * 2  # K and V, every layer, fp16
    host_bytes_per_s: float = 25e9
    swap_fixed_s: float = 200e-6
    flops_per_token: float = 2 * 135e6
    attn_flops_per_token_pair: float = 2 * 30 * 576
    device_flops_per_s: float = 100e12

    def swap_cost(self, num_tokens: int) -> float:
        return self.swap_fixed_s + 2 * num_tokens * self.kv_bytes_per_token / self.host_bytes_per_s

    def recompute_cost(self, num_tokens: int) -> float:
        return (num_tokens * self.flops_per_token
                + self.attn_flops_per_token_pair * num_tokens ** 2) / self.device_flops_per_s

    def swap_threshold_tokens(self) -> int:
        """Smallest length at which swapping is no dearer than recomputing."""
        a = 2 * self.kv_bytes_per_token / self.host_bytes_per_s
        b = self.flops_per_token / self.device_flops_per_s
        q = self.attn_flops_per_token_pair / self.device_flops_per_s
        c = self.swap_fixed_s
        root = (-(b - a) + math.sqrt((b - a) ** 2 + 4 * q * c)) / (2 * q)
        return math.ceil(root)


DEFAULT_SWAP_THRESHOLD_TOKENS = PreemptionCostModel().swap_threshold_tokens()


class PreemptionChooser:
    """Swap or recompute for one victim under --preemption-mode (SchedulerConfig checks it)."""

    def __init__(self, mode: str, swap_threshold_tokens: int | None = None) -> None:
        self.mode = mode
        self.swap_threshold_tokens = (DEFAULT_SWAP_THRESHOLD_TOKENS if swap_threshold_tokens is None
                                      else swap_threshold_tokens)

    def choose(self, num_tokens: int, can_swap: bool) -> str:
        """`can_swap` is False when the host pool cannot take it: recompute is always possible."""
        if not can_swap or self.mode == RECOMPUTE:
            return RECOMPUTE
        if self.mode == SWAP:
            return SWAP
        return SWAP if num_tokens >= self.swap_threshold_tokens else RECOMPUTE

