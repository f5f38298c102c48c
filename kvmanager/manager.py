"""The scheduler's KV-cache bookkeeping: per-sequence block tables over a device block pool,
with prefix caching, copy-on-write, fork and swapping to a host pool."""

from __future__ import annotations

from typing import Iterable, Sequence

from pagedserve.kvmanager import prefix_cache
from pagedserve.kvmanager.block_pool import BlockPool, NoFreeBlocksError
from pagedserve.kvmanager.seq_blocks import KVStats, SeqBlocks
from pagedserve.shm_tables import SharedBlockTables
from pagedserve.kvmanager.swap import (
    link_pools,
    live_part,
    num_blocks_to_swap,
    swap_seq,
)
from pagedserve.kvmanager.window import num_out_of_window, release_at


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Block tables of live sequences; every block's refcount equals its references from the
    tables' live entries (those after a sequence's released, out-of-window placeholders)."""

    def __init__(self, num_gpu_blocks: int, block_size: int = 16, num_cpu_blocks: int = 0, *,
                 enable_prefix_caching: bool = True, watermark: float = 0.01,
                 block_tables: SharedBlockTables | None = None, sliding_window: int = 0) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if num_gpu_blocks <= 0:
            raise ValueError(f"num_gpu_blocks must be positive, got {num_gpu_blocks}")
        if num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {num_cpu_blocks}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        if sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0 (0: none), got {sliding_window}")
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.gpu_pool = BlockPool(num_gpu_blocks, enable_caching=enable_prefix_caching)
        self.cpu_pool = BlockPool(num_cpu_blocks, enable_caching=False)
        link_pools(self.gpu_pool, self.cpu_pool)
        self.block_tables = block_tables
        self._free_rows: list[int] = []
        # Rows of sequences freed while workers may still read them (see hold_rows).
        self._held_rows: list[int] = []
        self._holding_rows = False
        if block_tables is not None:
            if not block_tables.is_owner:
                raise ValueError("the manager must own its shared block tables, not attach them")
            self._free_rows = list(range(block_tables.max_num_seqs - 1, -1, -1))
        self._seqs: dict[int, SeqBlocks] = {}
        self._prefix_queries = 0
        self._prefix_hits = 0
        self.tiers = None  # the KV tiers below the device pool (kvmanager/tiers.py), if any

    def attach_tiers(self, tiers) -> None:
        """Blocks cached from now on are stored in `tiers`, and prefixes are looked up there
        past the device-cached blocks (kvmanager/tiers.py)."""
        self.tiers = tiers
        self.gpu_pool.on_cached = tiers.on_cached

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.gpu_pool.num_free_blocks

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.cpu_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.gpu_pool.num_used_blocks / self.num_gpu_blocks

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def seq_ids(self) -> list[int]:
        return list(self._seqs)

    def block_table(self, seq_id: int) -> list[int]:
        """The sequence's block ids in order (host ids while it is swapped out); the first
        num_released_blocks are placeholders: device ids it no longer holds."""
        return list(self._seq(seq_id).block_ids)

    def num_released_blocks(self, seq_id: int) -> int:
        """Leading table entries released out of the sliding window (0 without a window)."""
        return self._seq(seq_id).num_released

    def window_release_at(self, seq_id: int) -> int:
        """The num_computed_tokens from which slide_window releases the sequence's next block
        (window.NO_RELEASE without a window)."""
        return release_at(self._seq(seq_id).num_released, self.sliding_window, self.block_size)

    def num_tokens(self, seq_id: int) -> int:
        """Token slots reserved for the sequence; its table holds cdiv(that, block_size) blocks."""
        return self._seq(seq_id).num_tokens

    def is_swapped(self, seq_id: int) -> bool:
        return self._seq(seq_id).swapped

    def row_of(self, seq_id: int) -> int:
        """The sequence's row in the shared block tables (stable from allocate to free), -1
        for a manager without shared tables."""
        return self._seq(seq_id).row

    def stats(self) -> KVStats:
        return KVStats(
            gpu_blocks_used=self.gpu_pool.num_used_blocks, gpu_blocks_total=self.num_gpu_blocks,
            cpu_blocks_used=self.cpu_pool.num_used_blocks, cpu_blocks_total=self.num_cpu_blocks,
            usage=self.usage, prefix_queries=self._prefix_queries,
            prefix_hits=self._prefix_hits)

    # ---- prefix cache (kvmanager/prefix_cache.py) ------------------------------------------

    def lookup_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Leading tokens already cached: whole blocks, always < len(token_ids). No side effect."""
        return len(prefix_cache.cached_prefix(self, token_ids, cache_salt)[1]) * self.block_size

    def lookup_prefix_tiers(self, token_ids: Sequence[int], cache_salt: str | None = None
                            ) -> tuple[int, int]:
        """(leading tokens cached on the device or, after those, in a lower KV tier; of them
        the ones in a lower tier, which `allocate` loads into fresh device blocks). No side
        effect but the disk tier's index learning of files another replica wrote."""
        hashes, cached = prefix_cache.cached_prefix(self, token_ids, cache_salt)
        lower = prefix_cache.lower_tier_prefix(self, token_ids, cache_salt, hashes)
        return (len(cached) + len(lower)) * self.block_size, len(lower) * self.block_size

    def cache_blocks(self, seq_id: int, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Full blocks among the first ``num_computed_tokens`` become findable by their hash."""
        if self.enable_prefix_caching:
            prefix_cache.cache_full_blocks(self, seq_id, self._seq(seq_id), token_ids,
                                           num_computed_tokens)

    def commit_blocks(self, items: Iterable[tuple[int, Sequence[int], int, int]]) -> None:
        """``append_slots`` + ``cache_blocks`` for many sequences after a step (the scheduler's
        update path). For each ``(seq_id, token_ids, num_tokens, num_computed_tokens)``, in
        order: the sequence now holds ``num_tokens`` slots, grown inside its own blocks (slots
        it reserved lazily; RuntimeError if that would take a block or a copy), and the full
        blocks among its first ``num_computed_tokens`` become findable."""
        prefix_cache.commit_blocks(self, items)

    # ---- allocation ------------------------------------------------------------------------

    def _fresh_blocks_needed(self, num_new_tokens: int, num_cached_tokens: int) -> int:
        bs = self.block_size
        return _cdiv(num_cached_tokens + num_new_tokens, bs) - num_cached_tokens // bs

    def can_allocate(self, num_new_tokens: int, *, num_cached_tokens: int = 0) -> bool:
        """Fresh blocks for the new tokens fit while leaving the watermark of free blocks."""
        needed = self._fresh_blocks_needed(num_new_tokens, num_cached_tokens)
        return self.gpu_pool.num_free_blocks - needed >= self.watermark_blocks

    def allocate(self, seq_id: int, token_ids: Sequence[int], num_new_tokens: int,
                 cache_salt: str | None = None, *, read_cache: bool = True) -> int | None:
        """New sequence takes its cached prefix plus fresh blocks for ``num_new_tokens`` more.
        Under a sliding window, cached blocks already out of the window of its first step are
        not taken: their entries are placeholders from the start. ``read_cache=False``: no
        cached prefix (every token is computed; its full blocks are still cached after).

        Returns the number of cached tokens, or None with nothing changed if blocks are short.
        """
        if seq_id in self._seqs:
            raise ValueError(f"seq {seq_id} is already allocated")
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        hashes, cached = (prefix_cache.cached_prefix(self, token_ids, cache_salt) if read_cache
                          else ([], []))
        lower = (prefix_cache.lower_tier_prefix(self, token_ids, cache_salt, hashes)
                 if read_cache and self.tiers is not None else [])
        num_cached_tokens = len(cached) * self.block_size
        num_lower_tokens = len(lower) * self.block_size  # loaded into fresh blocks
        num_fresh = self._fresh_blocks_needed(num_new_tokens + num_lower_tokens,
                                              num_cached_tokens)
        num_released = num_out_of_window(num_cached_tokens, self.sliding_window, self.block_size)
        taken = cached[num_released:]
        num_revived = sum(1 for block in taken if block.ref_cnt == 0)
        self._check_table_width(seq_id, len(cached) + num_fresh)
        if num_fresh + num_revived > self.gpu_pool.num_free_blocks:
            return None
        if self.block_tables is not None and not self._free_rows:
            raise RuntimeError(
                f"cannot allocate seq {seq_id}: all {self.block_tables.max_num_seqs} "
                f"block-table rows are in use (max_num_seqs)")
        self.gpu_pool.touch(taken)
        block_ids = [b.block_id for b in cached]
        fresh = self.gpu_pool.allocate(num_fresh)
        block_ids.extend(b.block_id for b in fresh)
        if lower:
            self._load_lower(lower, fresh, hashes)
            num_cached_tokens += num_lower_tokens
        seq = SeqBlocks(block_ids, num_cached_tokens + num_new_tokens, cache_salt, hashes,
                         num_released=num_released)
        if self.block_tables is not None:
            seq.row = self._free_rows.pop()
            self._write_row(seq)
        self._seqs[seq_id] = seq
        if self.enable_prefix_caching:
            self._prefix_queries += len(token_ids)
            self._prefix_hits += num_cached_tokens
        return num_cached_tokens

    def _load_lower(self, lower, fresh, hashes) -> None:
        """The leading fresh blocks take the lower tiers' blocks: cached under their hashes
        now (the plan loads them before any step reads them) and loaded by the workers."""
        bs, pool, tiers = self.block_size, self.gpu_pool, self.tiers
        for (block_hash, tier), block in zip(lower, fresh):
            pool.cache_block(block, block_hash)
            tiers.plan_load(tier, block_hash, block.block_id, bs)
            hashes.append(block_hash)

    def num_blocks_to_append(self, seq_id: int, num_new_tokens: int) -> int:
        """Free blocks append_slots(seq_id, num_new_tokens) would take, copy-on-write included."""
        seq = self._seq(seq_id)
        return self._append_need(seq, num_new_tokens)[0]

    def can_append_slots(self, seq_id: int, num_new_tokens: int) -> bool:
        return self.num_blocks_to_append(seq_id, num_new_tokens) <= self.gpu_pool.num_free_blocks

    def _append_need(self, seq: SeqBlocks, num_new_tokens: int) -> tuple[int, bool]:
        bs = self.block_size
        n = seq.num_tokens
        num_new_blocks = _cdiv(n + num_new_tokens, bs) - len(seq.block_ids)
        cow = (num_new_tokens > 0 and n % bs != 0
               and self.gpu_pool.blocks[seq.block_ids[-1]].ref_cnt > 1)
        return num_new_blocks + cow, cow

    def append_slots(self, seq_id: int, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Reserve ``num_new_tokens`` more slots; a shared partial last block is copied first.

        Returns the copy-on-write (src, dst) pairs (usually none), or None with nothing changed
        if the device pool is short.
        """
        seq = self._seqs.get(seq_id)
        if seq is None or seq.swapped or num_new_tokens < 0:
            self._reject_append(seq_id, seq, num_new_tokens)
        n = seq.num_tokens
        block_ids = seq.block_ids
        # Hot path: the new slots fit in a last block that only this sequence holds.
        if (n + num_new_tokens <= len(block_ids) * self.block_size
                and (num_new_tokens == 0
                     or self.gpu_pool.blocks[block_ids[-1]].ref_cnt == 1)):
            seq.num_tokens = n + num_new_tokens
            return []
        needed, cow = self._append_need(seq, num_new_tokens)
        if needed > self.gpu_pool.num_free_blocks:
            return None
        self._check_table_width(seq_id, len(block_ids) + needed - cow)
        fresh = self.gpu_pool.allocate(needed)
        copies = []
        first_new = len(block_ids)
        if cow:
            src = self.gpu_pool.blocks[block_ids[-1]]
            dst = fresh.pop(0)
            src.ref_cnt -= 1  # still > 0: another sequence holds it
            block_ids[-1] = dst.block_id
            copies.append((src.block_id, dst.block_id))
            first_new -= 1
        block_ids.extend(b.block_id for b in fresh)
        seq.num_tokens = n + num_new_tokens
        if seq.row >= 0:
            self.block_tables.array[seq.row, first_new:len(block_ids)] = block_ids[first_new:]
        return copies

    def reserve_slots(self, seq_id: int, num_tokens: int) -> list[int] | None:
        """Grow the sequence to ``num_tokens`` slots in all when that needs no copy-on-write:
        the decode fast path. Returns the ids of the blocks appended (often none), or None with
        nothing changed when its partial last block is shared or the device pool is short
        (``append_slots`` then copies or reports the shortage)."""
        seq = self._seqs.get(seq_id)
        if seq is None or seq.swapped:
            self._reject_append(seq_id, seq, 0)
        n = seq.num_tokens
        if num_tokens < n:
            raise ValueError(f"seq {seq_id} already holds {n} slots, cannot shrink to "
                             f"{num_tokens}")
        block_ids = seq.block_ids
        bs = self.block_size
        num_blocks = len(block_ids)
        if num_tokens > n and n % bs and self.gpu_pool.blocks[block_ids[-1]].ref_cnt > 1:
            return None  # writing into a shared partial block: copy-on-write first
        num_new = -(-num_tokens // bs) - num_blocks
        if num_new <= 0:
            seq.num_tokens = num_tokens
            return []
        pool = self.gpu_pool
        if num_new > pool.free_block_queue.num_free_blocks:
            return None
        if self.block_tables is not None:
            self._check_table_width(seq_id, num_blocks + num_new)
        new_ids = [b.block_id for b in pool.allocate(num_new)]
        block_ids += new_ids
        seq.num_tokens = num_tokens
        if seq.row >= 0:
            if num_new == 1:  # a decode crossing into its next block: a scalar store is cheaper
                self.block_tables.array[seq.row, num_blocks] = new_ids[0]
            else:
                self.block_tables.array[seq.row, num_blocks:num_blocks + num_new] = new_ids
        return new_ids

    def _reject_append(self, seq_id: int, seq: SeqBlocks | None, num_new_tokens: int):
        if seq is None:
            raise KeyError(f"seq {seq_id} is not allocated (never allocated or already freed)")
        if seq.swapped:
            raise ValueError(f"seq {seq_id} is swapped out; swap it in before appending")
        raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block the parent holds (one more reference each) and its
        placeholders."""
        parent = self._seq(parent_id)
        if child_id in self._seqs:
            raise ValueError(f"cannot fork into seq {child_id}: it is already allocated")
        if parent.swapped:
            raise ValueError(f"cannot fork seq {parent_id}: it is swapped out")
        if self.block_tables is not None and not self._free_rows:
            raise RuntimeError(f"cannot fork seq {parent_id}: all "
                               f"{self.block_tables.max_num_seqs} block-table rows are in use")
        blocks = self.gpu_pool.blocks
        self.gpu_pool.touch(blocks[b] for b in parent.block_ids[parent.num_released:])
        child = SeqBlocks(list(parent.block_ids), parent.num_tokens, parent.cache_salt,
                           list(parent.block_hashes), num_released=parent.num_released)
        if self.block_tables is not None:
            child.row = self._free_rows.pop()
            self._write_row(child)
        self._seqs[child_id] = child

    def free(self, seq_id: int) -> None:
        """Drop the sequence and its references, tail block first (prefixes outlive suffixes)."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise KeyError(f"cannot free seq {seq_id}: it is not allocated "
                           f"(never allocated or already freed)")
        pool = self.cpu_pool if seq.swapped else self.gpu_pool
        pool.free(pool.blocks[b] for b in reversed(seq.block_ids[seq.num_released:]))
        if seq.row >= 0:
            if self._holding_rows:
                self._held_rows.append(seq.row)
            else:
                self.block_tables.array[seq.row].fill(-1)
                self._free_rows.append(seq.row)

    def slide_window(self, seq_id: int, num_computed_tokens: int) -> list[int]:
        """Before a step computing from position ``num_computed_tokens``: the blocks wholly
        before its window go back to the pool, tail first, and their entries become
        placeholders. Returns their ids in table order ([] without a window)."""
        seq = self._seq(seq_id)
        if seq.swapped:
            raise ValueError(f"seq {seq_id} is swapped out; slide its window before swapping")
        if num_computed_tokens > len(seq.block_ids) * self.block_size:
            raise ValueError(f"seq {seq_id}: {num_computed_tokens} computed tokens but its "
                             f"{len(seq.block_ids)} blocks hold fewer slots")
        end = num_out_of_window(num_computed_tokens, self.sliding_window, self.block_size)
        start = seq.num_released
        if end <= start:
            return []
        released = seq.block_ids[start:end]
        blocks = self.gpu_pool.blocks
        self.gpu_pool.free(blocks[b] for b in reversed(released))
        seq.num_released = end
        return released

    def hold_rows(self, holding: bool) -> None:
        """While holding, a freed sequence's shared row keeps its entries and is not reused.

        Workers read the rows of a step's sequences when the step starts; the scheduler holds
        rows from sending a plan until its result is back, so an abort arriving meanwhile
        cannot blank (or hand to another sequence) a row a worker is about to read. Releasing
        clears and frees the rows held back."""
        self._holding_rows = holding
        if not holding and self._held_rows:
            for row in self._held_rows:
                self.block_tables.array[row].fill(-1)
            self._free_rows.extend(self._held_rows)
            self._held_rows.clear()

    def drop_device_pool(self, unreliable_cpu_blocks=()) -> list[int]:
        """The device pool's bytes are lost (the workers restarted); the host pool survives.

        Frees every sequence on the device, and every swapped-out one holding any of
        `unreliable_cpu_blocks` (copies that a lost step may not have written); both must be
        recomputed, and their ids are returned. Swapped-out sequences otherwise keep their host
        blocks. The device pool starts empty: no prefix-cache entries, and no host block claims
        a device copy any more.
        """
        unreliable = set(unreliable_cpu_blocks)
        dropped = [sid for sid, seq in self._seqs.items()
                   if not seq.swapped or unreliable.intersection(seq.block_ids)]
        for sid in dropped:
            self.free(sid)
        self.gpu_pool = BlockPool(self.num_gpu_blocks, enable_caching=self.enable_prefix_caching)
        for block in self.cpu_pool.blocks:
            block.swap_copy = None
        link_pools(self.gpu_pool, self.cpu_pool)
        if self.tiers is not None:
            self.tiers.device_lost()
            self.gpu_pool.on_cached = self.tiers.on_cached
        return dropped

    # ---- swapping --------------------------------------------------------------------------

    def _swap_need(self, seq: SeqBlocks, to_cpu: bool, num_computed: int | None) -> int:
        src, dst = (self.gpu_pool, self.cpu_pool) if to_cpu else (self.cpu_pool, self.gpu_pool)
        return num_blocks_to_swap(src, dst, *live_part(seq, self.block_size, num_computed))

    def can_swap_out(self, seq_id: int, num_computed: int | None = None) -> bool:
        """The host pool has room for the sequence's blocks not already copied there.
        `num_computed` (here and in the swaps): see swap.live_part."""
        seq = self._seq(seq_id)
        return (not seq.swapped
                and self._swap_need(seq, True, num_computed) <= self.cpu_pool.num_free_blocks)

    def can_swap_in(self, seq_id: int, num_computed: int | None = None) -> bool:
        """The device pool has room for the sequence's blocks above the watermark."""
        seq = self._seq(seq_id)
        if not seq.swapped:
            return False
        needed = self._swap_need(seq, False, num_computed)
        return self.gpu_pool.num_free_blocks - needed >= self.watermark_blocks

    def swap_out(self, seq_id: int, num_computed: int | None = None) -> list[tuple[int, int]]:
        """Move the sequence to the host pool; returns (gpu_block, cpu_block) pairs to copy.
        Placeholders stay as they are (device ids, never swapped)."""
        seq = self._seq(seq_id)
        if seq.swapped:
            raise ValueError(f"seq {seq_id} is already swapped out")
        mapping = swap_seq(seq, self.gpu_pool, self.cpu_pool, self.block_size,
                           f"swap_out of seq {seq_id} (host pool)", num_computed)
        if seq.row >= 0:
            self.block_tables.array[seq.row].fill(-1)
        return mapping

    def swap_in(self, seq_id: int, num_computed: int | None = None) -> list[tuple[int, int]]:
        """Bring the sequence back to the device pool; returns (cpu_block, gpu_block) pairs.

        Raises NoFreeBlocksError, changing nothing, when it cannot fit.
        """
        seq = self._seq(seq_id)
        if not seq.swapped:
            raise ValueError(f"seq {seq_id} is not swapped out")
        mapping = swap_seq(seq, self.cpu_pool, self.gpu_pool, self.block_size,
                           f"swap_in of seq {seq_id} (device pool)", num_computed)
        blocks, r = self.gpu_pool.blocks, seq.num_released
        for block_id, block_hash in zip(seq.block_ids[r:], seq.block_hashes[r:]):
            self.gpu_pool.cache_block(blocks[block_id], block_hash)
        if seq.row >= 0:
            self._write_row(seq)
        return mapping

    # ---- helpers ---------------------------------------------------------------------------

    def _seq(self, seq_id: int) -> SeqBlocks:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise KeyError(f"seq {seq_id} is not allocated (never allocated or already freed)")
        return seq

    def _check_table_width(self, seq_id: int, num_blocks: int) -> None:
        if self.block_tables is not None and num_blocks > self.block_tables.max_blocks_per_seq:
            raise ValueError(
                f"seq {seq_id} would need {num_blocks} blocks but the shared block tables "
                f"hold at most {self.block_tables.max_blocks_per_seq} per sequence")

    def _write_row(self, seq: SeqBlocks) -> None:
        row = self.block_tables.array[seq.row]
        n = len(seq.block_ids)
        row[:n] = seq.block_ids
        row[n:] = -1


__all__ = ["KVCacheManager", "KVStats", "NoFreeBlocksError"]
