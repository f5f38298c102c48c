"""A sequence's KV slots against what the KV manager knows of them.

A sequence holds `num_reserved_tokens` slots; the manager has been told of `num_kv_tokens`.
Slots inside the sequence's own (unshared) last block are taken without telling the manager,
which saves a manager call on most decode steps; `sync_kv` reports them before anything that
needs the manager's count to be exact (a fork, a swap, a preemption).
"""
from __future__ import annotations

from pagedserve.pipeline.scheduler.sequence import Sequence


def grow(seq: Sequence, num_new: int, kv, copies: list[tuple[int, int]]) -> bool:
    """Hold slots up to num_computed + num_new; False (nothing changed) if blocks are short.
    A shared partial last block is copied first: the (src, dst) pair goes to `copies`."""
    needed = seq.num_computed_tokens + num_new
    if needed <= seq.num_reserved_tokens:
        return True
    bs = kv.block_size
    if not seq.shared_tail and needed <= -(-seq.num_kv_tokens // bs) * bs:
        seq.hold_slots(needed, reported=False)  # inside its own last block
        return True
    cow = kv.append_slots(seq.seq_id, needed - seq.num_kv_tokens)
    if cow is None:
        return False
    seq.hold_slots(needed, reported=True)
    if cow:
        copies.extend(cow)
        seq.table_changed()  # a block in its table was replaced
    return True


def sync_kv(seq: Sequence, kv) -> None:
    """Report lazily held slots to the manager (they never need a block or a copy)."""
    lag = seq.num_reserved_tokens - seq.num_kv_tokens
    if lag:
        cow = kv.append_slots(seq.seq_id, lag)
        if cow is None or cow:
            raise RuntimeError(f"seq {seq.seq_id}: lazily held slots needed a block or a "
                               f"copy ({cow}); the slot bookkeeping is wrong")
        seq.reported_slots(seq.num_reserved_tokens)


def can_swap_in(seq: Sequence, chunk: int, kv, num_watermark_blocks: int) -> bool:
    """Room above the watermark for its blocks and for the ones its next chunk adds, so a
    swapped-in sequence can run at once instead of being pushed straight back out."""
    if not kv.can_swap_in(seq.seq_id, seq.num_computed_tokens):
        return False
    bs = kv.block_size
    table = -(-seq.num_reserved_tokens // bs)  # blocks a sliding window released included
    held = table - kv.num_released_blocks(seq.seq_id)
    more = max(0, -(-(seq.num_computed_tokens + chunk) // bs) - table)
    return kv.num_free_blocks - held - more >= num_watermark_blocks
