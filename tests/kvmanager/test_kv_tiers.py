"""KV tiers below the device pool: the block files, the tiers' indexes and the manager's loads."""
import os

import pytest

from pagedserve.kv_tier_files import (HEADER, TierFileError, block_path, namespace_digest,
                                      open_tier_dir, read_block, scan_blocks, write_block)
from pagedserve.kvmanager import KVCacheManager
from pagedserve.kvmanager.tiers import DiskTier, HostTier, KVTiers
from pagedserve.private_files import PrivateFileError

NS = namespace_digest(model="m", block_size=4)
H1, H2, H3 = (bytes([i]) * 32 for i in (1, 2, 3))


def test_a_block_file_reads_back_and_every_bad_file_is_refused(tmp_path):
    d = open_tier_dir(str(tmp_path / "tier"), NS)
    assert os.stat(d).st_mode & 0o777 == 0o700
    write_block(d, NS, H1, b"x" * 64)
    assert read_block(d, NS, H1, 64) == b"x" * 64
    assert os.stat(block_path(d, H1)).st_mode & 0o777 == 0o600
    with pytest.raises(TierFileError, match="another model"):
        read_block(d, namespace_digest(model="other", block_size=4), H1, 64)
    with pytest.raises(TierFileError, match="has 148 bytes"):
        read_block(d, NS, H1, 32)
    raw = bytearray(open(block_path(d, H1), "rb").read())
    raw[HEADER.size + 5] ^= 1
    open(block_path(d, H1), "wb").write(raw)
    with pytest.raises(TierFileError, match="checksum"):
        read_block(d, NS, H1, 64)
    os.rename(block_path(d, H1), block_path(d, H2))  # a file under another block's name
    with pytest.raises(TierFileError):
        read_block(d, NS, H2, 64)
    with pytest.raises(FileNotFoundError):
        read_block(d, NS, H3, 64)


def test_the_directory_must_be_private(tmp_path):
    root = tmp_path / "open"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    with pytest.raises(PrivateFileError, match="open to other users"):
        open_tier_dir(str(root), NS)


def test_scan_lists_block_files_and_removes_a_dead_writers_temporary_file(tmp_path):
    d = open_tier_dir(str(tmp_path), NS)
    write_block(d, NS, H2, b"a")
    write_block(d, NS, H1, b"b")
    os.utime(block_path(d, H2), (1000, 1000))
    dead = os.path.join(d, ".tmp-999999999-abc")  # no such pid: its writer was killed
    live = os.path.join(d, f".tmp-{os.getpid()}-abc")
    for path in (dead, live):
        open(path, "wb").write(b"partial")
        os.utime(path, (1000, 1000))
    open(os.path.join(d, "notes.txt"), "w").write("ignored")
    assert [h for h, _ in scan_blocks(d, now=1000 + 120)] == [H2, H1]
    assert not os.path.exists(dead) and os.path.exists(live)


def test_host_tier_evicts_its_least_recently_used_block():
    host = HostTier(2)
    assert host.store(H1) == 0 and host.store(H2) == 1
    host.use(0)                      # H1 read: H2 is now the oldest
    assert host.store(H3) == 1
    assert host.slot_of(H2) is None and host.slot_of(H1) == 0 and host.slot_of(H3) == 1


def test_disk_tier_deletes_past_its_capacity_and_finds_other_replicas_files(tmp_path):
    disk = DiskTier(str(tmp_path), NS, capacity=2)
    disk.add(H1)
    disk.add(H2)
    disk.use(H1)
    disk.add(H3)
    assert list(disk.index) == [H1, H3] and disk.pending_deletes == [H2]
    other = bytes([9]) * 32
    write_block(disk.directory, NS, other, b"z")   # another replica's block
    assert disk.contains(other) and other in disk.index


def _manager(tmp_path, num_gpu=6, host=4):
    kv = KVCacheManager(num_gpu, block_size=4, enable_prefix_caching=True)
    tiers = KVTiers(HostTier(host) if host else None,
                    DiskTier(str(tmp_path), NS, 100) if tmp_path else None, block_bytes=10)
    kv.attach_tiers(tiers)
    return kv, tiers


def _compute(kv, seq_id, tokens):
    assert kv.allocate(seq_id, tokens, len(tokens)) == 0
    kv.cache_blocks(seq_id, tokens, len(tokens))
    kv.free(seq_id)


def test_evicted_prefix_comes_back_from_the_host_tier(tmp_path):
    kv, tiers = _manager(None, host=10)
    prompt = list(range(13))                    # 3 full blocks + 1 token
    _compute(kv, 1, prompt)
    tiers.begin_step()                          # the next plan stores the 3 cached blocks
    assert tiers.take_ops() == ([0, 1, 2], [0, 1, 2], [], [], [], [])
    _compute(kv, 2, list(range(100, 124)))      # 6 blocks: every cached block is evicted
    assert kv.lookup_prefix(prompt) == 0
    assert kv.lookup_prefix_tiers(prompt) == (12, 12)
    tiers.begin_step()
    tiers.take_ops()                            # (the second prompt's stores)
    assert kv.allocate(3, prompt, 1) == 12
    ops = tiers.take_ops()
    assert ops[3] == [(0, kv.block_table(3)[0]), (1, kv.block_table(3)[1]),
                      (2, kv.block_table(3)[2])]
    assert tiers.stats()["kv_host_loads"] == 3 and tiers.stats()["kv_host_hit_tokens"] == 12
    assert kv.lookup_prefix(prompt) == 12       # the loaded blocks are cached on the device


def test_a_block_evicted_before_its_store_is_not_stored(tmp_path):
    kv, tiers = _manager(None, num_gpu=4)
    _compute(kv, 1, list(range(13)))            # blocks 0-2 cached (3: partial), stores pending
    _compute(kv, 2, list(range(50, 63)))        # takes 3, 2, 1, 0: all evicted before a plan
    tiers.begin_step()                          # only the second prompt's blocks are stored
    assert tiers.take_ops()[0] == [3, 2, 1] and tiers.stats()["kv_host_stores"] == 3


def test_disk_hits_past_the_host_tier_and_failures_forget_the_block(tmp_path):
    kv, tiers = _manager(tmp_path, host=0)
    prompt = list(range(9))
    _compute(kv, 1, prompt)
    tiers.begin_step()
    stores = tiers.take_ops()
    assert stores[0] == [0, 1] and stores[1] == [-1, -1] and len(stores[2]) == 2
    _compute(kv, 2, list(range(100, 124)))
    tiers.begin_step()
    tiers.take_ops()
    assert kv.lookup_prefix_tiers(prompt) == (8, 8)
    tiers.on_failed([stores[2][1]])              # the second block's file could not be written
    assert kv.lookup_prefix_tiers(prompt) == (4, 4)
    assert tiers.stats()["kv_disk_failures"] == 1


def test_tier_counters_are_exported_per_tier():
    from pagedserve.pipeline.ingress.metrics import _kv_tiers
    families = {f.name: f for f in _kv_tiers({"kv_host_loads": 3, "kv_disk_failures": 2})}
    loads = {s.labels["tier"]: s.value for s in families["pagedserve:kv_tier_loads"].samples}
    failures = {s.labels["tier"]: s.value
                for s in families["pagedserve:kv_tier_failures"].samples}
    assert loads == {"host": 3.0, "disk": 0.0} and failures == {"host": 0.0, "disk": 2.0}
