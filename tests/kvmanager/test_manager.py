"""Exact small-pool tests: block size 4, a pool of 10 blocks, known tokens, exact block ids."""

import pytest

from pagedserve.kvmanager import KVCacheManager, NoFreeBlocksError, hash_full_blocks


def free_ids(m):
    return [b.block_id for b in m.gpu_pool.free_block_queue]


def refs(m, ids, pool="gpu"):
    p = m.gpu_pool if pool == "gpu" else m.cpu_pool
    return [p.blocks[i].ref_cnt for i in ids]


def test_allocate_then_prefix_hit_shares_full_blocks():
    m = KVCacheManager(10, block_size=4, watermark=0.0)
    prompt = list(range(10))
    assert m.allocate(1, prompt, 10) == 0
    assert m.block_table(1) == [0, 1, 2] and m.num_tokens(1) == 10 and m.num_free_blocks == 7
    assert m.lookup_prefix(prompt) == 0  # nothing cached before the blocks are computed
    m.cache_blocks(1, prompt, 10)
    assert m.lookup_prefix(prompt) == 8
    assert m.lookup_prefix(prompt[:8]) == 4  # the last prompt token is always computed
    assert m.lookup_prefix(prompt[:9]) == 8
    assert m.lookup_prefix(prompt, cache_salt="tenant-b") == 0
    other = prompt[:8] + [100, 101, 102]
    assert m.allocate(2, other, 3) == 8
    assert m.block_table(2) == [0, 1, 3] and m.num_tokens(2) == 11
    assert refs(m, [0, 1, 2, 3]) == [2, 2, 1, 1]
    s = m.stats()
    assert (s.prefix_queries, s.prefix_hits) == (21, 8)
    assert (s.gpu_blocks_used, s.gpu_blocks_total, s.usage) == (4, 10, 0.4)
    m.free(2)
    m.free(1)
    assert m.stats().gpu_blocks_used == 0 and m.usage == 0.0


def test_allocate_without_reading_the_cache_computes_every_token():
    """A request that needs every position computed (prompt logprobs) takes fresh blocks
    although its prefix is cached; once computed, its blocks leave the cached ones in place."""
    m = KVCacheManager(10, block_size=4, watermark=0.0)
    prompt = list(range(10))
    m.allocate(1, prompt, 10)
    m.cache_blocks(1, prompt, 10)
    assert m.allocate(2, prompt, 10, read_cache=False) == 0
    assert m.block_table(2) == [3, 4, 5] and refs(m, [0, 1, 2]) == [1, 1, 1]
    m.cache_blocks(2, prompt, 10)
    assert m.lookup_prefix(prompt) == 8
    m.free(1)
    assert m.allocate(3, prompt, 2) == 8 and m.block_table(3)[:2] == [0, 1]


def test_eviction_order_is_lru_and_tail_first():
    m = KVCacheManager(10, block_size=4, watermark=0.0)
    a, b = list(range(12)), list(range(100, 112))
    for seq_id, toks in ((1, a), (2, b)):
        m.allocate(seq_id, toks, 12)
        m.cache_blocks(seq_id, toks, 12)
    assert m.block_table(1) == [0, 1, 2] and m.block_table(2) == [3, 4, 5]
    m.free(1)
    m.free(2)
    # Freed tail first: each request's last block is the first of its blocks to be evicted.
    assert free_ids(m) == [6, 7, 8, 9, 2, 1, 0, 5, 4, 3]
    assert m.lookup_prefix(a + [0]) == 12 and m.lookup_prefix(b + [0]) == 12
    assert m.allocate(3, list(range(200, 220)), 20) == 0
    assert m.block_table(3) == [6, 7, 8, 9, 2]  # block 2 (a's suffix) evicted
    assert m.lookup_prefix(a + [0]) == 8 and m.lookup_prefix(b + [0]) == 12
    # A hit on free cached blocks revives them from the middle of the queue.
    assert free_ids(m) == [1, 0, 5, 4, 3]
    assert m.allocate(4, a[:8] + [50], 1) == 8
    assert m.block_table(4) == [0, 1, 5] and free_ids(m) == [4, 3]
    assert m.lookup_prefix(b + [0]) == 8  # b's last block was handed out


def test_uncached_blocks_are_reused_before_cached_ones():
    m = KVCacheManager(6, block_size=4, watermark=0.0)
    cached = list(range(8))
    m.allocate(1, cached, 8)
    m.cache_blocks(1, cached, 8)
    m.allocate(2, [9] * 6, 6)  # never cached
    m.free(1)
    m.free(2)
    assert free_ids(m) == [2, 3, 4, 5, 1, 0]
    assert m.allocate(3, [7] * 16, 16) == 0
    assert m.block_table(3) == [2, 3, 4, 5]
    assert m.lookup_prefix(cached + [1]) == 8


def test_whole_prompt_hit_still_computes_the_last_block():
    m = KVCacheManager(10, block_size=4, watermark=0.0)
    p = list(range(8))
    m.allocate(1, p, 8)
    m.cache_blocks(1, p, 8)
    assert m.allocate(2, p, 4) == 4
    assert m.block_table(2) == [0, 2]
    m.cache_blocks(2, p, 8)  # block 2 duplicates block 1's hash: the cache keeps block 1
    assert m.gpu_pool.blocks[2].block_hash is None
    m.free(1)
    m.free(2)
    assert free_ids(m) == [2, 3, 4, 5, 6, 7, 8, 9, 1, 0]


def test_cache_salt_isolates_tenants():
    m = KVCacheManager(10, block_size=4, watermark=0.0)
    p = list(range(9))
    m.allocate(1, p, 9, cache_salt="alice")
    m.cache_blocks(1, p, 9)
    assert m.lookup_prefix(p, "alice") == 8
    assert m.lookup_prefix(p, "bob") == 0 and m.lookup_prefix(p) == 0
    assert m.allocate(2, p, 9, cache_salt="bob") == 0


def test_chunked_prefill_caches_blocks_as_they_are_computed():
    m = KVCacheManager(10, block_size=4, watermark=0.0)
    p = list(range(14))
    assert m.allocate(1, p, 6) == 0 and m.block_table(1) == [0, 1]
    m.cache_blocks(1, p, 6)
    assert m.lookup_prefix(p) == 4
    assert m.append_slots(1, 8) == [] and m.block_table(1) == [0, 1, 2, 3]
    m.cache_blocks(1, p, 14)
    assert m.lookup_prefix(p + [99]) == 12
    with pytest.raises(ValueError, match="exceeds its 14 reserved slots"):
        m.cache_blocks(1, p + [1, 2], 16)


def test_append_slots_allocates_only_on_block_boundaries():
    m = KVCacheManager(10, block_size=4, watermark=0.0)
    m.allocate(1, [1, 2, 3], 3)
    assert m.block_table(1) == [0]
    assert m.append_slots(1, 1) == [] and m.block_table(1) == [0] and m.num_tokens(1) == 4
    assert m.append_slots(1, 1) == [] and m.block_table(1) == [0, 1]
    assert m.append_slots(1, 6) == [] and m.block_table(1) == [0, 1, 2] and m.num_tokens(1) == 11
    assert m.append_slots(1, 0) == [] and m.num_tokens(1) == 11


def test_reserve_slots_returns_new_block_ids_and_defers_copy_on_write():
    m = KVCacheManager(6, block_size=4, watermark=0.0)
    m.allocate(1, [1, 2, 3], 3)
    assert m.reserve_slots(1, 4) == [] and m.num_tokens(1) == 4  # inside its last block
    assert m.reserve_slots(1, 4) == []  # no growth
    assert m.reserve_slots(1, 5) == [1] and m.block_table(1) == [0, 1]
    assert m.reserve_slots(1, 13) == [2, 3] and m.num_tokens(1) == 13
    with pytest.raises(ValueError, match="cannot shrink"):
        m.reserve_slots(1, 12)
    m.fork(1, 2)  # shares the partial block 3
    assert m.reserve_slots(2, 14) is None  # copy-on-write: append_slots' job
    assert m.num_tokens(2) == 13 and m.block_table(2) == [0, 1, 2, 3]
    assert m.reserve_slots(2, 13) == []  # nothing written into the shared block
    assert m.append_slots(2, 1) == [(3, 4)]
    assert m.reserve_slots(1, 25) is None  # 3 more blocks, 1 free: nothing changed
    assert m.num_tokens(1) == 13 and m.block_table(1) == [0, 1, 2, 3] and m.num_free_blocks == 1
    with pytest.raises(KeyError, match="seq 7 is not allocated"):
        m.reserve_slots(7, 1)


def test_commit_blocks_reports_lazy_slots_and_caches_full_blocks():
    m = KVCacheManager(8, block_size=4, watermark=0.0)
    toks = [1, 2, 3, 4, 5, 6]
    m.allocate(1, toks, 6)  # blocks 0, 1; slots 6 and 7 not reserved yet
    m.allocate(2, [9] * 5, 5, cache_salt="s")
    toks += [7, 8]
    m.commit_blocks([(1, toks, 8, 8), (2, [9] * 8, 8, 8)])
    assert m.num_tokens(1) == 8 and m.lookup_prefix(toks + [9]) == 8
    assert m.num_tokens(2) == 8 and m.lookup_prefix([9] * 9, "s") == 8
    assert m._seqs[1].block_hashes == hash_full_blocks(toks, 4)  # same hashes as cache_blocks
    assert m._seqs[2].block_hashes == hash_full_blocks([9] * 8, 4, "s")
    m.commit_blocks([(1, toks, 8, 8)])  # nothing new
    with pytest.raises(RuntimeError, match="needs a block or a copy"):
        m.commit_blocks([(1, toks, 9, 8)])  # slot 8 lies in a block it does not have
    with pytest.raises(ValueError, match="cannot shrink"):
        m.commit_blocks([(1, toks, 7, 7)])
    with pytest.raises(ValueError, match="exceeds the 8 token ids"):
        m.append_slots(1, 4)
        m.commit_blocks([(1, toks, 12, 12)])
    with pytest.raises(ValueError, match="int64 range"):
        m.commit_blocks([(1, toks + [1, 2, 3, 2**70], 12, 12)])
    m.allocate(4, [5] * 5, 5)
    m.fork(4, 5)  # their partial last block is shared
    with pytest.raises(RuntimeError, match="needs a block or a copy"):
        m.commit_blocks([(5, [5] * 6, 6, 4)])
    assert m.num_tokens(5) == 5 and m.stats().gpu_blocks_used == 7


def test_commit_blocks_batch_keeps_the_order_of_single_calls():
    m = KVCacheManager(12, block_size=4, watermark=0.0)
    same = [1, 2, 3, 4, 5]
    for seq_id in (1, 2, 3):
        m.allocate(seq_id, same, 5)
    # seqs 1 and 2 fill the same block contents: the first one listed is the cached block
    m.commit_blocks([(2, same, 5, 4), (1, same, 5, 4), (2, same, 5, 4)])  # 2 listed twice
    assert m.gpu_pool.cached_blocks[hash_full_blocks(same, 4)[0]].block_id == m.block_table(2)[0]
    assert len(m._seqs[2].block_hashes) == 1 and len(m._seqs[1].block_hashes) == 1
    # an item that fails: the ones before it are done, the ones after it untouched
    m.allocate(4, [7] * 3, 3)
    with pytest.raises(RuntimeError, match="needs a block or a copy"):
        m.commit_blocks([(4, [7] * 4, 4, 4), (3, same, 9, 4), (4, [7] * 4, 4, 4)])
    assert m.lookup_prefix([7] * 5) == 4 and m.lookup_prefix(same) == 4
    assert m.num_tokens(3) == 5 and m._seqs[3].block_hashes == []
    # several blocks at once and single blocks, mixed: same hashes as cache_blocks
    toks = list(range(20, 33))
    m.allocate(5, toks, 13)
    m.commit_blocks([(5, toks, 13, 8), (3, same + [6, 7, 8], 8, 8), (5, toks, 13, 12)])
    assert m._seqs[5].block_hashes == hash_full_blocks(toks, 4)
    assert m._seqs[3].block_hashes == hash_full_blocks(same + [6, 7, 8], 4)


def test_copy_on_write_after_fork():
    m = KVCacheManager(10, block_size=4, watermark=0.0)
    m.allocate(1, list(range(6)), 6)
    m.fork(1, 2)
    assert m.block_table(2) == [0, 1] and refs(m, [0, 1]) == [2, 2]
    assert m.append_slots(1, 1) == [(1, 2)]  # parent writes into the shared partial block
    assert m.block_table(1) == [0, 2] and refs(m, [0, 1, 2]) == [2, 1, 1]
    assert m.append_slots(2, 1) == []  # the child is now the only holder of block 1
    assert m.block_table(2) == [0, 1]
    assert m.append_slots(2, 3) == [] and m.block_table(2) == [0, 1, 3]
    m.free(1)
    assert refs(m, [0, 1, 2, 3]) == [1, 1, 0, 1]
    m.free(2)
    assert m.num_free_blocks == 10


def test_copy_on_write_and_growth_in_one_append():
    m = KVCacheManager(10, block_size=4, watermark=0.0)
    m.allocate(1, list(range(5)), 5)
    m.fork(1, 2)
    assert m.append_slots(2, 6) == [(1, 2)]
    assert m.block_table(2) == [0, 2, 3] and m.num_tokens(2) == 11


def test_fork_at_a_block_boundary_needs_no_copy():
    m = KVCacheManager(10, block_size=4, watermark=0.0)
    m.allocate(1, list(range(8)), 8)
    m.fork(1, 2)
    m.fork(1, 3)
    assert refs(m, [0, 1]) == [3, 3]
    assert m.append_slots(1, 1) == [] and m.block_table(1) == [0, 1, 2]
    assert m.append_slots(3, 1) == [] and m.block_table(3) == [0, 1, 3]


def test_failed_allocation_and_append_change_nothing():
    m = KVCacheManager(4, block_size=4, watermark=0.0)
    p = list(range(9))
    m.allocate(1, p, 9)
    m.cache_blocks(1, p, 9)
    m.free(1)
    before = (free_ids(m), dict(m.gpu_pool.cached_blocks), m.stats())
    # 8 cached tokens (2 free cached blocks to revive) + 3 fresh blocks > 4 free
    assert m.allocate(2, p + [1] * 8, 9) is None
    assert 2 not in m and (free_ids(m), dict(m.gpu_pool.cached_blocks), m.stats()) == before
    assert m.allocate(2, p, 1) == 8 and m.block_table(2) == [0, 1, 2]
    m.fork(2, 3)
    assert m.allocate(4, [5] * 4, 4) == 0  # the last free block
    assert m.append_slots(2, 1) is None  # copy-on-write needs a block
    assert m.num_tokens(2) == 9 and m.block_table(2) == [0, 1, 2] and refs(m, [2]) == [2]
    assert not m.can_append_slots(2, 1) and m.num_blocks_to_append(2, 1) == 1


def test_can_allocate_respects_the_watermark():
    m = KVCacheManager(100, block_size=4, watermark=0.05)
    assert m.watermark_blocks == 5
    assert m.can_allocate(95 * 4) and not m.can_allocate(95 * 4 + 1)
    assert m.can_allocate(95 * 4, num_cached_tokens=8)  # 95 fresh blocks
    assert not m.can_allocate(95 * 4 + 1, num_cached_tokens=8)
    assert m.allocate(1, [1] * 400, 400) == 0  # allocate itself ignores the watermark
    assert m.num_free_blocks == 0 and not m.can_allocate(1)


def test_errors_name_the_cause():
    m = KVCacheManager(4, block_size=4)
    m.allocate(1, [1, 2], 2)
    with pytest.raises(ValueError, match="seq 1 is already allocated"):
        m.allocate(1, [1], 1)
    with pytest.raises(KeyError, match="seq 7 is not allocated"):
        m.append_slots(7, 1)
    with pytest.raises(ValueError, match="num_new_tokens must be >= 0"):
        m.append_slots(1, -1)
    m.free(1)
    with pytest.raises(KeyError, match="cannot free seq 1"):
        m.free(1)
    with pytest.raises(ValueError, match="block_size must be positive"):
        KVCacheManager(4, block_size=0)


def test_swap_out_and_in_reuse_intact_copies():
    m = KVCacheManager(10, block_size=4, num_cpu_blocks=6, watermark=0.0)
    m.allocate(1, list(range(10)), 10)
    assert m.can_swap_out(1) and not m.can_swap_in(1)
    assert m.swap_out(1) == [(0, 0), (1, 1), (2, 2)]
    assert m.is_swapped(1) and m.block_table(1) == [0, 1, 2]
    assert m.num_free_blocks == 10 and m.num_free_cpu_blocks == 3
    # The device copies of the full blocks are still intact: only the partial block moves.
    assert free_ids(m) == [2, 3, 4, 5, 6, 7, 8, 9, 1, 0]
    assert m.can_swap_in(1)
    assert m.swap_in(1) == [(2, 2)]
    assert m.block_table(1) == [0, 1, 2] and m.num_free_cpu_blocks == 6
    assert m.swap_out(1) == [(2, 2)]
    s = m.stats()
    assert (s.cpu_blocks_used, s.cpu_blocks_total, s.gpu_blocks_used) == (3, 6, 0)
    m.free(1)
    assert m.num_free_cpu_blocks == 6 and m.num_free_blocks == 10


def test_swap_in_after_device_blocks_were_reused_copies_everything():
    m = KVCacheManager(4, block_size=4, num_cpu_blocks=4, watermark=0.0)
    m.allocate(1, list(range(8)), 8)
    assert m.swap_out(1) == [(0, 0), (1, 1)]
    m.allocate(2, [3] * 16, 16)  # takes every device block, breaking the links
    assert not m.can_swap_in(1)
    with pytest.raises(NoFreeBlocksError, match=r"swap_in of seq 1 \(device pool\) needs 2 free blocks but only 0"):
        m.swap_in(1)
    assert m.is_swapped(1) and m.num_free_cpu_blocks == 2
    m.free(2)
    assert m.swap_in(1) == [(0, 2), (1, 3)]
    assert m.block_table(1) == [2, 3]


def test_forked_sequences_share_their_swapped_blocks():
    m = KVCacheManager(10, block_size=4, num_cpu_blocks=6, watermark=0.0)
    m.allocate(1, list(range(10)), 10)
    m.fork(1, 2)
    assert m.swap_out(1) == [(0, 0), (1, 1), (2, 2)]
    assert m.swap_out(2) == [(2, 3)]  # full blocks 0 and 1 already have host copies
    assert m.block_table(2) == [0, 1, 3] and refs(m, [0, 1, 2, 3], "cpu") == [2, 2, 1, 1]
    assert m.swap_in(1) == [(2, 2)]
    assert m.swap_in(2) == [(3, 3)]
    assert m.block_table(1) == [0, 1, 2] and m.block_table(2) == [0, 1, 3]
    assert refs(m, [0, 1, 2, 3]) == [2, 2, 1, 1]


def test_swap_out_fails_cleanly_when_the_host_pool_is_short():
    m = KVCacheManager(10, block_size=4, num_cpu_blocks=2, watermark=0.0)
    m.allocate(1, list(range(10)), 10)
    assert not m.can_swap_out(1)
    with pytest.raises(NoFreeBlocksError, match=r"swap_out of seq 1 \(host pool\) needs 3 free blocks"):
        m.swap_out(1)
    assert not m.is_swapped(1) and m.block_table(1) == [0, 1, 2] and m.num_free_cpu_blocks == 2


def test_swapped_in_blocks_become_prefix_hits_again():
    m = KVCacheManager(4, block_size=4, num_cpu_blocks=4, watermark=0.0)
    p = list(range(9))
    m.allocate(1, p, 9)
    m.cache_blocks(1, p, 9)
    m.swap_out(1)
    m.allocate(2, [7] * 16, 16)  # evicts every cached device block
    assert m.lookup_prefix(p) == 0
    m.free(2)
    m.swap_in(1)
    assert m.lookup_prefix(p) == 8


def test_drop_device_pool_keeps_reliable_swapped_sequences_only():
    m = KVCacheManager(10, block_size=4, num_cpu_blocks=10, watermark=0.0)
    a, b, c = list(range(8)), list(range(20, 28)), list(range(40, 46))
    m.allocate(1, a, 8)
    m.allocate(2, b, 8)
    m.allocate(3, c, 6)
    m.cache_blocks(1, a, 8)
    assert m.swap_out(1) == [(0, 0), (1, 1)]
    assert m.swap_out(2) == [(2, 2), (3, 3)]  # say this swap-out was in the lost step
    assert m.drop_device_pool(unreliable_cpu_blocks=[2, 3]) == [2, 3]
    assert m.seq_ids() == [1] and m.is_swapped(1)
    s = m.stats()
    assert (s.gpu_blocks_used, s.cpu_blocks_used) == (0, 2)
    assert m.lookup_prefix(a + [99]) == 0  # the device prefix cache went with the bytes
    # The host copy has no device copy to reuse any more: everything is copied back.
    assert m.swap_in(1) == [(0, 0), (1, 1)] and m.block_table(1) == [0, 1]
    assert m.stats().cpu_blocks_used == 0
