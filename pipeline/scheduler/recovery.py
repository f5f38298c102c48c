"""Recovery after the worker group lost its KV cache (a rank died, hung or raised)."""
from __future__ import annotations

import heapq

from pipeline.sequence import SequenceStatus


def requeue_for_recompute(scheduler) -> int:
    """Forget every block and queue every live sequence to be recomputed from its tokens.

    The device pool's contents are gone, so the KV manager (block tables, refcounts, prefix
    cache) starts empty, and so does the host pool (the new workers' swap space is empty too).
    Each sequence keeps its prompt and generated tokens, is sent to the workers in full again,
    and samples only once it has caught up: streams resume where they stopped. The plan in
    flight, if any, is dropped. Returns how many sequences were requeued.
    """
    kv = scheduler.kv
    fresh = type(kv)(kv.num_gpu_blocks, kv.block_size, kv.num_cpu_blocks,
                     enable_prefix_caching=scheduler.config.enable_prefix_caching,
                     watermark=scheduler.config.watermark, block_tables=kv.block_tables)
    if kv.block_tables is not None:
        kv.block_tables.array.fill(-1)
    scheduler.kv = fresh
    scheduler._inflight = None
    scheduler._finished_seq_ids = []
    live = [s for s in scheduler.seqs.values() if not s.is_finished]
    scheduler.waiting, scheduler.swapped, scheduler.running, scheduler.prefilling = [], [], [], []
    scheduler.num_running = scheduler.num_swapped = scheduler.num_waiting = 0
    for seq in live:
        seq.num_computed_tokens = seq.num_reserved_tokens = seq.num_kv_tokens = 0
        seq.shared_tail = False
        seq.num_tokens_sent = seq.num_blocks_sent = seq.step_tokens = 0
        seq.needs_full_send = True
        seq.preempted_step = -1
        seq.status = SequenceStatus.WAITING
        scheduler.num_waiting += 1
        scheduler.waiting.append((scheduler.policy.key(seq), seq))
    heapq.heapify(scheduler.waiting)
    return len(live)
