"""Preemption: which running sequence to push out, and whether to swap or recompute it.

The victim is the running sequence with the largest policy key not yet planned this step; the
functions at the end take the Scheduler, whose state they change (as recovery.py does).

Swap or recompute, by a cost model (seconds to get a preempted sequence of T tokens back to
where it was):

    swap(T)      = c + 2 * T * kv_bytes_per_token / host_bytes_per_s
                   (its K/V go to the host pool and come back: bytes over the host link, twice,
                   plus a fixed overhead c for the launches and synchronisation of one round trip)
    recompute(T) = (T * flops_per_token + attn_flops_per_token_pair * T**2) / device_flops_per_s
                   (a prefill of T tokens: linear layers ~ 2 * params per token, causal attention
                   ~ 2 * layers * hidden per pair of tokens, so quadratic in T)

Both grow with T, but recompute has no fixed cost and grows quadratically, so short sequences
are cheaper to recompute and long ones cheaper to swap. The break-even length is the positive
root of  q T^2 + (b - a) T - c = 0  with a, b the per-token swap and recompute costs and q the
quadratic coefficient. With the defaults below (SmolLM2-135M in fp16: 30 layers, 3 KV heads of
64, hidden 576; a 25 GB/s host link, ~100 TFLOP/s achieved, 200 us per swap round trip) it is
about 210 tokens: ``auto`` recomputes sequences shorter than that and swaps the rest. Set
``SchedulerConfig.swap_threshold_tokens`` to override, or derive one for another model with
``PreemptionCostModel(...).swap_threshold_tokens()``.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedserve.pipeline.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from pagedserve.pipeline.scheduler.decode import PlanBuilder
    from pagedserve.pipeline.scheduler.scheduler import Scheduler

RUNNING = SequenceStatus.RUNNING
WAITING = SequenceStatus.WAITING
SWAPPED = SequenceStatus.SWAPPED
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
    """Picks swap or recompute for one victim under --preemption-mode swap|recompute|auto."""

    def __init__(self, mode: str, swap_threshold_tokens: int | None = None) -> None:
        if mode not in (SWAP, RECOMPUTE, "auto"):
            raise ValueError(f"preemption_mode must be swap, recompute or auto, got {mode!r}")
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


# ---------------------------------------------------------------- making room: victims

def reserve_or_preempt(sched: Scheduler, seq: Sequence, num_new: int, b: PlanBuilder) -> bool:
    """Make room for `num_new` more tokens of `seq`, preempting others (or `seq` itself,
    returning False) when the pool is short."""
    while not sched._grow(seq, num_new, b):
        victim = pick_victim(sched, b.step_id)
        preempt(sched, victim, b)
        if victim is seq:
            return False
    return True


def pick_victim(sched: Scheduler, step_id: int) -> Sequence:
    """The running sequence not yet scheduled this step with the largest policy key."""
    key = sched.policy.key
    best, best_key = None, None
    for seqs in (sched.running, sched.prefilling):
        for seq in seqs:
            if seq.status is RUNNING and seq.last_step != step_id:
                k = key(seq)
                if best_key is None or k > best_key:
                    best, best_key = seq, k
    if best is None:
        raise RuntimeError("no sequence left to preempt; the caller should have been a candidate")
    return best


def preempt_for_waiting(sched: Scheduler, b: PlanBuilder) -> None:
    """Let the waiting head push out running sequences it outranks when blocks are short."""
    while sched.waiting and sched.waiting[0][1].status is not WAITING:
        heapq.heappop(sched.waiting)
    if not sched.waiting:
        return
    head = sched.waiting[0][1]
    tokens = head.token_ids
    cached = (sched.kv.lookup_prefix(tokens, head.request.cache_salt)
              if sched.config.enable_prefix_caching else 0)
    need = min(len(tokens) - cached, sched.config.max_num_batched_tokens)
    while not sched.kv.can_allocate(need, num_cached_tokens=cached):
        victim = pick_victim(sched, b.step_id) if sched.num_running else None
        if victim is None or not sched.policy.may_preempt(head, victim):
            return
        preempt(sched, victim, b)


def preempt(sched: Scheduler, seq: Sequence, b: PlanBuilder) -> None:
    """Push a running sequence out: to the host pool or back to the waiting queue."""
    kv = sched.kv
    sched._sync_kv(seq)
    can_swap = kv.num_cpu_blocks > 0 and kv.can_swap_out(seq.seq_id)
    sched.num_preemptions += 1
    sched._remove_running(seq)
    seq.preempted_step = b.step_id
    seq.needs_full_send = True  # swap-in and recompute both change its block table
    seq.lane_cap = -1
    if sched.preemption.choose(len(seq.token_ids), can_swap) == SWAP:
        b.swap_out.extend(kv.swap_out(seq.seq_id))
        seq.status = SWAPPED
        sched.num_swapped += 1
        heapq.heappush(sched.swapped, (sched.policy.key(seq), seq))
    else:
        kv.free(seq.seq_id)
        seq.num_computed_tokens = seq.num_reserved_tokens = seq.num_kv_tokens = 0
        seq.shared_tail = False
        sched._push_waiting(seq)
