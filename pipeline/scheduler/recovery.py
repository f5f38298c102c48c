"""Recovery after the worker group lost its device KV cache (a rank died, hung or raised)."""
from __future__ import annotations

import heapq

from pagedserve.pipeline.sequence import SequenceStatus


def requeue_for_recompute(scheduler) -> int:
    """Forget the device pool and queue the sequences that lived there for recompute.

    The device pool's contents are gone, so its block tables, refcounts and prefix cache start
    empty. The host swap pool lives in shared memory and survives the workers: sequences
    swapped out by completed steps stay swapped and come back by swap-in. Sequences swapped out
    by the step that was lost (its copies may never have happened) are recomputed, as is every
    sequence that was on the device. A recomputed sequence keeps its prompt and generated
    tokens, is sent to the workers in full again, and samples only once it has caught up:
    streams resume where they stopped. Returns how many sequences will be recomputed.
    """
    kv = scheduler.kv
    lost_plan = scheduler._inflight
    unreliable = [cpu for _gpu, cpu in lost_plan.swap_out] if lost_plan is not None else []
    dropped = set(kv.drop_device_pool(unreliable))
    scheduler._inflight = None
    scheduler._finished_seq_ids = []
    live = [s for s in scheduler.seqs.values() if not s.is_finished]
    scheduler.waiting, scheduler.swapped, scheduler.running, scheduler.prefilling = [], [], [], []
    scheduler.num_running = scheduler.num_swapped = scheduler.num_waiting = 0
    scheduler.num_unforked = 0
    for seq in live:
        seq.num_tokens_sent = seq.num_blocks_sent = seq.step_tokens = 0
        seq.needs_full_send = True
        seq.preempted_step = -1
        seq.lane_cap = -1
        key = (scheduler.policy.key(seq), seq)
        if seq.seq_id in kv and seq.seq_id not in dropped:  # swapped out, host copy intact
            seq.status = SequenceStatus.SWAPPED
            scheduler.num_swapped += 1
            scheduler.swapped.append(key)
            continue
        seq.num_computed_tokens = seq.num_reserved_tokens = seq.num_kv_tokens = 0
        seq.shared_tail = False
        seq.status = SequenceStatus.WAITING
        scheduler.num_waiting += 1
        scheduler.waiting.append(key)
    heapq.heapify(scheduler.waiting)
    heapq.heapify(scheduler.swapped)
    return scheduler.num_waiting
