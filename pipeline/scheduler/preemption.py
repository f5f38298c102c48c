"""Preemption: whether a victim (`SequenceQueues.victim`, moved out by `RequestLifecycle.preempt`)
is swapped out or recomputed, by the cost model of docs/ARCHITECTURE.md's "Preemption"."""
from __future__ import annotations

import math
from dataclasses import dataclass

SWAP = "swap"
RECOMPUTE = "recompute"


@dataclass(frozen=True, slots=True)
class PreemptionCostModel:
    """Seconds to get a preempted sequence of T tokens back, by swap or by recompute; the
    defaults are SmolLM2-135M in fp16, a 25 GB/s host link, ~100 TFLOP/s, 200 us a swap."""

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


def swap_or_recompute(mode: str, num_tokens: int, can_swap: bool,
                      swap_threshold_tokens: int | None = None) -> str:
    """Swap or recompute a victim of `num_tokens` under --preemption-mode (SchedulerConfig
    checks it). `can_swap` is False when the host pool cannot take it: recompute always can."""
    if not can_swap or mode == RECOMPUTE:
        return RECOMPUTE
    if mode == SWAP:
        return SWAP
    if swap_threshold_tokens is None:
        swap_threshold_tokens = DEFAULT_SWAP_THRESHOLD_TOKENS
    return SWAP if num_tokens >= swap_threshold_tokens else RECOMPUTE
