"""A worker rank's side of the KV tiers (kvmanager/tiers.py plans them): the host tier's
blocks in this process's memory, and the disk tier's files (pagedserve/kv_tier_files.py),
written by one background thread so that no step waits for the disk.

`KVTierIO.apply(ops)` runs at a step's start, before the swaps and the forward:
  1. the stored device blocks are gathered into one private copy (their contents now, before
     anything in this step overwrites them);
  2. the loads are written into their device blocks: host-tier slots, then disk files read and
     checked here (a load is on the prefill's path by nature);
  3. the gathered copy goes into its host-tier slots and, block by block, to the writer's
     queue (bounded: a full queue drops the write).
A disk load or write that fails is logged, counted and reported (`take_failed`); the caller
recomputes the blocks a failed load was to fill.
"""
from __future__ import annotations

import logging
import queue
import threading

import torch

from pagedserve.kv_tier_files import (TierFileError, model_fingerprint, namespace_digest,
                                      open_tier_dir, read_block, remove_block, write_block)
from pagedserve.kernels.kv_format import raw

log = logging.getLogger(__name__)

# Bytes of block copies waiting for the writer at most; past it a store is dropped (reported).
MAX_PENDING_BYTES = 256 << 20


class DiskWriter:
    """One thread writing (and deleting) block files in queue order."""

    def __init__(self, directory: str, namespace: bytes, max_pending_bytes: int) -> None:
        self.directory, self.namespace = directory, namespace
        self.max_pending_bytes = max_pending_bytes
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._pending_bytes = 0
        self._failed: list[bytes] = []
        self.num_failed = 0
        self._thread = threading.Thread(target=self._run, name="kv-tier-writer", daemon=True)
        self._thread.start()

    def put(self, block_hash: bytes, payload) -> None:
        """Queue one block's bytes (a buffer: bytes, a numpy array) for its file."""
        with self._lock:
            if self._pending_bytes + len(payload) > self.max_pending_bytes:
                self._fail(block_hash, "the writer's queue is full (the disk is slower than "
                                       "the blocks computed)")
                return
            self._pending_bytes += len(payload)
        self._queue.put((block_hash, payload))

    def delete(self, block_hash: bytes) -> None:
        self._queue.put((block_hash, None))

    def take_failed(self) -> list[bytes]:
        with self._lock:
            failed, self._failed = self._failed, []
        return failed

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is done (True) or `timeout` passed (False)."""
        done = threading.Event()
        self._queue.put((None, done))
        return done.wait(timeout)

    def _fail(self, block_hash: bytes, why: str) -> None:
        """Under the lock: report the block, log the first failures and every 100th after."""
        self._failed.append(block_hash)
        self.num_failed += 1
        if self.num_failed <= 3 or self.num_failed % 100 == 0:
            log.warning("disk tier: block %s not stored (%s); it will be recomputed when "
                        "needed (%d blocks failed so far)", block_hash.hex()[:16], why,
                        self.num_failed)

    def _run(self) -> None:
        while True:
            block_hash, payload = self._queue.get()
            if block_hash is None:
                payload.set()
                continue
            if payload is None:
                try:
                    remove_block(self.directory, block_hash)
                except OSError as exc:
                    log.warning("disk tier: cannot delete block %s: %s", block_hash.hex()[:16],
                                exc)
                continue
            try:
                write_block(self.directory, self.namespace, block_hash, payload)
            except OSError as exc:
                with self._lock:
                    self._fail(block_hash, f"{exc.strerror or exc}")
            finally:
                with self._lock:
                    self._pending_bytes -= len(payload)


class KVTierIO:
    def __init__(self, kv_cache: torch.Tensor, num_host_blocks: int, disk_dir: str | None,
                 namespace: bytes, max_pending_bytes: int = MAX_PENDING_BYTES) -> None:
        self.kv_cache = kv_cache
        shape = list(kv_cache.shape)
        shape[2] = num_host_blocks
        pin = kv_cache.is_cuda and num_host_blocks > 0
        self.host = torch.zeros(shape, dtype=kv_cache.dtype, device="cpu", pin_memory=pin) \
            if num_host_blocks else None
        self.block_shape = shape[:2] + shape[3:]
        self.block_nbytes = kv_cache[:, :, 0].numel() * kv_cache.element_size()
        self.disk_dir, self.namespace = disk_dir, namespace
        self.writer = DiskWriter(disk_dir, namespace, max_pending_bytes) if disk_dir else None
        self._failed_loads: list[bytes] = []
        self.num_failed_loads = 0

    def apply(self, ops) -> set[int]:
        """Apply a plan's TierOps (see the module's docstring); returns the device blocks a
        failed disk load left unfilled."""
        kv = raw(self.kv_cache)
        staged = None
        if ops.store_blocks:
            index = torch.tensor(ops.store_blocks, dtype=torch.long, device=kv.device)
            staged = kv.index_select(2, index).cpu()
        if ops.load_host:
            src = torch.tensor([s for s, _ in ops.load_host], dtype=torch.long)
            dst = torch.tensor([d for _, d in ops.load_host], dtype=torch.long, device=kv.device)
            kv.index_copy_(2, dst, raw(self.host).index_select(2, src).to(kv.device))
        unfilled = self._load_disk(kv, ops.load_disk) if ops.load_disk else set()
        if staged is not None:
            self._store(staged, ops.store_slots, ops.store_hashes)
        if self.writer is not None:
            for block_hash in ops.delete:
                self.writer.delete(block_hash)
        return unfilled

    def _load_disk(self, kv: torch.Tensor, loads: list[tuple[bytes, int]]) -> set[int]:
        unfilled = set()
        for block_hash, block in loads:
            try:
                if self.disk_dir is None:
                    raise TierFileError("this worker has no disk tier (--kv-offload-dir)")
                payload = read_block(self.disk_dir, self.namespace, block_hash,
                                     self.block_nbytes)
            except (OSError, TierFileError) as exc:
                unfilled.add(block)
                self._failed_loads.append(block_hash)
                self.num_failed_loads += 1
                log.warning("disk tier: block %s not loaded (%s); recomputing it",
                            block_hash.hex()[:16], exc)
                continue
            data = torch.frombuffer(payload, dtype=kv.dtype).view(self.block_shape)
            kv[:, :, block] = data.to(kv.device)
        return unfilled

    def _store(self, staged: torch.Tensor, slots: list[int], hashes: list[bytes]) -> None:
        if self.host is not None:
            rows = [i for i, slot in enumerate(slots) if slot >= 0]
            if rows:
                picked = staged if len(rows) == len(slots) else staged[:, :, rows]
                raw(self.host).index_copy_(2, torch.tensor([slots[i] for i in rows]), picked)
        if self.writer is not None:
            for i, block_hash in enumerate(hashes):
                if block_hash:
                    block = staged[:, :, i].contiguous().view(torch.uint8).reshape(-1)
                    self.writer.put(block_hash, block.numpy())

    def take_failed(self) -> list[bytes]:
        """The hashes of the disk stores and loads that failed since the last call."""
        failed, self._failed_loads = self._failed_loads, []
        if self.writer is not None:
            failed += self.writer.take_failed()
        return failed

    def close(self, timeout: float = 10.0) -> None:
        """Finish the queued writes (a graceful stop), waiting at most `timeout` seconds."""
        if self.writer is not None and not self.writer.flush(timeout):
            log.warning("disk tier: writes still queued after %.0fs at stop; those blocks "
                        "will be recomputed", timeout)


def build_tier_io(cfg, kv_cache: torch.Tensor, block_bytes: int, model_config, rank: int
                  ) -> KVTierIO:
    """This rank's KV tiers from --kv-offload-memory / --kv-offload-dir. The namespace of the
    disk tier's files covers what makes two caches' bytes interchangeable."""
    c, tp = cfg.cache, cfg.parallel.tensor_parallel_size
    if c.kv_offload_dir and tp > 1:
        raise ValueError(f"--kv-offload-dir serves one worker rank (its blocks are whole "
                         f"files); --tensor-parallel-size is {tp}")
    namespace = namespace_digest(
        model=model_fingerprint(cfg.model.model), cache_dtype=str(kv_cache.dtype),
        block_size=c.block_size, layout=list(kv_cache.shape[:2]) + list(kv_cache.shape[3:]),
        tp=[rank, tp], quantization=cfg.model.quantization, format=1)
    directory = open_tier_dir(c.kv_offload_dir, namespace) if c.kv_offload_dir else None
    num_host = c.kv_offload_memory // block_bytes
    log.info("KV tiers: host %d blocks (%d MiB), disk %s", num_host,
             num_host * block_bytes >> 20, directory or "off")
    return KVTierIO(kv_cache, num_host, directory, namespace)
