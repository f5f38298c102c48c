"""KV cache tiers below the device pool: a host-memory tier and a disk tier, each holding full
blocks keyed by their prefix-cache hash (hashing.py: the chain covers the cache salt, so the
adapter; the disk tier's namespace covers model, dtype, block size and layout).

The scheduler owns what each tier holds; the workers move the bytes (workers/kv_tiers.py)
along the step plan's `TierOps`. Policy, as LMCache's and SGLang HiCache's write-through:
  - every block that becomes cached on the device is stored to the host tier and to the disk
    tier (unless already there), in the next plan, read by the workers at that step's start -
    before anything in the step can overwrite it; the disk write itself runs on the worker's
    writer thread, off the step's critical path;
  - each tier evicts its least recently used block when full (the disk tier deletes its file);
  - a prompt's prefix found in a lower tier, past its device-cached blocks, counts as cached:
    fresh device blocks are taken for it and loaded before the prefill computes.
A disk store or load can fail (full disk, I/O error, corrupt file, a writer killed): the
worker reports the hash, the tier forgets it, and a failed load is recomputed by the worker in
the same step, so output never changes.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from pagedserve.kv_tier_files import has_block, open_tier_dir, scan_blocks
from pagedserve.kvmanager.block_pool import Block, BlockPool
from pagedserve.kvmanager.hashing import BlockHash

HOST, DISK = "host", "disk"
# Blocks stored per step at most: a long prefill's blocks spread over a few steps' starts.
MAX_STORES_PER_STEP = 128


@dataclass(slots=True)
class TierCounts:
    """One tier's counters: prompt tokens served from it, blocks loaded and stored, failures."""
    hit_tokens: int = 0
    loads: int = 0
    stores: int = 0
    failures: int = 0


class HostTier:
    """The index of the worker's host-tier slots: LRU over block hashes (a BlockPool whose
    blocks are never held: each holds a hash or nothing, and the free queue is the LRU order)."""

    def __init__(self, num_blocks: int) -> None:
        self.pool = BlockPool(num_blocks, enable_caching=True)

    def slot_of(self, block_hash: BlockHash) -> int | None:
        block = self.pool.cached_blocks.get(block_hash)
        return None if block is None else block.block_id

    def store(self, block_hash: BlockHash) -> int:
        """A slot for the block, evicting the least recently used one."""
        (slot,) = self.pool.allocate(1)
        self.pool.cache_block(slot, block_hash)
        self.pool.free((slot,))
        return slot.block_id

    def use(self, slot: int) -> None:
        """The slot's block was read: it becomes the most recently used."""
        block = self.pool.blocks[slot]
        self.pool.touch((block,))
        self.pool.free((block,))


class DiskTier:
    """The index of the block files in the namespace's directory: LRU over hashes, at most
    `capacity` blocks. Files written by another replica sharing the directory are found by a
    check of the file when the index lacks the hash."""

    def __init__(self, root: str, namespace: bytes, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"the disk tier holds no block: --kv-offload-disk-size is smaller "
                             f"than one block")
        self.directory = open_tier_dir(root, namespace)
        self.capacity = capacity
        self.index: OrderedDict[BlockHash, None] = OrderedDict(
            (block_hash, None) for block_hash, _mtime in scan_blocks(self.directory))
        self.pending_deletes: list[BlockHash] = []
        self._trim()

    def contains(self, block_hash: BlockHash) -> bool:
        if block_hash in self.index:
            return True
        if has_block(self.directory, block_hash):
            self.add(block_hash)
            return True
        return False

    def use(self, block_hash: BlockHash) -> None:
        self.index.move_to_end(block_hash)

    def add(self, block_hash: BlockHash) -> None:
        self.index[block_hash] = None
        self._trim()

    def discard(self, block_hash: BlockHash) -> None:
        self.index.pop(block_hash, None)

    def _trim(self) -> None:
        while len(self.index) > self.capacity:
            evicted, _ = self.index.popitem(last=False)
            self.pending_deletes.append(evicted)


@dataclass(slots=True)
class _Pending:
    stores: list[tuple[Block, BlockHash]] = field(default_factory=list)  # cached, not picked
    store_blocks: list[int] = field(default_factory=list)
    store_slots: list[int] = field(default_factory=list)
    store_hashes: list[BlockHash] = field(default_factory=list)
    load_host: list[tuple[int, int]] = field(default_factory=list)
    load_disk: list[tuple[BlockHash, int]] = field(default_factory=list)


class KVTiers:
    """What the tiers below the device pool hold, and the moves the next plan carries."""

    def __init__(self, host: HostTier | None, disk: DiskTier | None, block_bytes: int) -> None:
        self.host, self.disk, self.block_bytes = host, disk, block_bytes
        self.counts = {HOST: TierCounts(), DISK: TierCounts()}
        self._pending = _Pending()

    def on_cached(self, block: Block, block_hash: BlockHash) -> None:
        """A device block became findable by its hash: store it below at the next step."""
        self._pending.stores.append((block, block_hash))

    def find(self, block_hash: BlockHash) -> str | None:
        """The highest lower tier holding the block (no side effect but the disk index
        learning of files another replica wrote)."""
        if self.host is not None and self.host.slot_of(block_hash) is not None:
            return HOST
        if self.disk is not None and self.disk.contains(block_hash):
            return DISK
        return None

    def plan_load(self, tier: str, block_hash: BlockHash, device_block: int,
                  num_tokens: int) -> None:
        """The block (`num_tokens` prompt tokens) comes back from `tier` into `device_block`
        before the step computes."""
        counts = self.counts[tier]
        counts.loads += 1
        counts.hit_tokens += num_tokens
        if tier == HOST:
            slot = self.host.slot_of(block_hash)
            self.host.use(slot)
            self._pending.load_host.append((slot, device_block))
        else:
            self.disk.use(block_hash)
            self._pending.load_disk.append((block_hash, device_block))

    def begin_step(self) -> None:
        """Before a plan allocates anything: pick the stores of the blocks cached since the
        last plan that are still cached under the same hash (the workers read them at the
        step's start, before the step's allocations can overwrite them)."""
        p = self._pending
        stores = p.stores[:MAX_STORES_PER_STEP]
        del p.stores[:MAX_STORES_PER_STEP]
        for block, block_hash in stores:
            if block.block_hash != block_hash:
                continue  # evicted before any step could read it
            slot = -1
            if self.host is not None and self.host.slot_of(block_hash) is None:
                slot = self.host.store(block_hash)
            to_disk = self.disk is not None and block_hash not in self.disk.index
            if to_disk:
                self.disk.add(block_hash)
            if slot < 0 and not to_disk:
                continue
            p.store_blocks.append(block.block_id)
            p.store_slots.append(slot)
            p.store_hashes.append(block_hash if to_disk else b"")
            self.counts[HOST].stores += slot >= 0
            self.counts[DISK].stores += to_disk

    def take_ops(self) -> tuple | None:
        """The moves of the plan just built, as TierOps' fields in order (stores, loads, files
        to delete); None: nothing to move."""
        p = self._pending
        deletes = self.disk.pending_deletes if self.disk is not None else []
        if not (p.store_blocks or p.load_host or p.load_disk or deletes):
            return None
        ops = (p.store_blocks, p.store_slots, p.store_hashes if self.disk is not None else [],
               p.load_host, p.load_disk, list(deletes))
        deletes.clear()
        self._pending = _Pending(p.stores)
        return ops

    def on_failed(self, block_hashes: list[BlockHash]) -> None:
        """The workers could not store or load these blocks on disk: forget them there."""
        for block_hash in block_hashes:
            self.counts[DISK].failures += 1
            if self.disk is not None:
                self.disk.discard(block_hash)

    def device_lost(self) -> None:
        """The workers restarted: the host tier lived in their memory, and the moves not sent
        yet name device blocks that are gone. The disk tier's files stay."""
        self._pending = _Pending()
        if self.host is not None:
            self.host = HostTier(self.host.pool.num_blocks)

    def stats(self) -> dict[str, int]:
        out = {}
        for tier, c in self.counts.items():
            moved = c.loads + c.stores
            out |= {f"kv_{tier}_hit_tokens": c.hit_tokens, f"kv_{tier}_loads": c.loads,
                    f"kv_{tier}_stores": c.stores, f"kv_{tier}_bytes": moved * self.block_bytes,
                    f"kv_{tier}_failures": c.failures}
        out["kv_host_blocks"] = self.host.pool.num_blocks if self.host is not None else 0
        out["kv_disk_blocks"] = len(self.disk.index) if self.disk is not None else 0
        return out


def build_tiers(num_host_blocks: int, block_bytes: int, namespace: bytes,
                directory: str | None, disk_bytes: int) -> KVTiers | None:
    """The tiers the workers reported (WorkerReady): None when they have neither."""
    host = HostTier(num_host_blocks) if num_host_blocks > 0 else None
    disk = None
    if directory and namespace:
        disk = DiskTier(directory, namespace, disk_bytes // max(block_bytes, 1))
    if host is None and disk is None:
        return None
    return KVTiers(host, disk, block_bytes)
