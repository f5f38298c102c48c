"""Sliding window: block size 4, window 8, a pool of a few blocks, exact block ids."""

import pytest
from pagedserve.kvmanager import KVCacheManager
from pagedserve.kvmanager.window import (
    NO_RELEASE,
    max_blocks_per_step,
    num_out_of_window,
)


def free_ids(m):
    return [b.block_id for b in m.gpu_pool.free_block_queue]


def refs(m, ids):
    return [m.gpu_pool.blocks[i].ref_cnt for i in ids]


def decode(m, seq_id, start, stop):
    """Steps computing one token at positions start..stop-1: slide, then reserve the slot.
    Returns {position: ids released before it} and the most blocks used at once."""
    released, peak = {}, 0
    for c in range(start, stop):
        if ids := m.slide_window(seq_id, c):
            released[c] = ids
        assert m.append_slots(seq_id, 1) == []
        peak = max(peak, m.stats().gpu_blocks_used)
    return released, peak


def test_window_arithmetic():
    # A step from c reads keys c-7..; block k (slots 4k..4k+3) is out once 4k+3 < c-7.
    assert [num_out_of_window(c, 8, 4) for c in (0, 7, 10, 11, 14, 15)] == [0, 0, 0, 1, 1, 2]
    assert num_out_of_window(100, 0, 4) == 0
    assert max_blocks_per_step(64, 4, 8, 4) == 4       # 11 keys + chunk straddle 4 blocks
    assert max_blocks_per_step(64, 4, 0, 4) == 16      # no window: every block
    assert max_blocks_per_step(10, 16, 8, 4) == 3      # never more than the whole sequence


def test_decoding_4x_the_window_holds_the_window_only():
    m = KVCacheManager(5, block_size=4, watermark=0.0, sliding_window=8,
                       enable_prefix_caching=False)
    assert m.allocate(1, list(range(6)), 6) == 0 and m.block_table(1) == [0, 1]
    released, peak = decode(m, 1, 6, 38)   # 32 tokens generated: 4x the window
    assert peak == 3 <= 8 // 4 + 2
    # Block k goes before the step at 4k+11; freed blocks (uncached) are reused first.
    assert released == {11: [0], 15: [1], 19: [2], 23: [0], 27: [1], 31: [2], 35: [0]}
    assert m.num_released_blocks(1) == 7 and m.window_release_at(1) == 39
    # Released entries keep their old ids: placeholders, valid device ids.
    assert m.block_table(1) == [0, 1, 2, 0, 1, 2, 0, 1, 2, 0] and m.num_tokens(1) == 38
    assert refs(m, [0, 1, 2, 3, 4]) == [1, 1, 1, 0, 0] and free_ids(m) == [3, 4]
    m.free(1)
    assert m.stats().gpu_blocks_used == 0 and free_ids(m) == [1, 2, 0, 3, 4]


def test_no_window_keeps_every_block():
    m = KVCacheManager(12, block_size=4, watermark=0.0, enable_prefix_caching=False)
    m.allocate(1, list(range(6)), 6)
    released, peak = decode(m, 1, 6, 38)
    assert released == {} and peak == 10 and m.num_released_blocks(1) == 0
    assert m.window_release_at(1) == NO_RELEASE
    assert m.block_table(1) == list(range(10))


def test_a_chunked_prompt_releases_between_chunks():
    m = KVCacheManager(6, block_size=4, watermark=0.0, sliding_window=8,
                       enable_prefix_caching=False)
    prompt = list(range(24))
    m.allocate(1, prompt, 12)                       # chunk 1: positions 0..11
    assert m.block_table(1) == [0, 1, 2]
    assert m.slide_window(1, 12) == [0]             # chunk 2 reads keys 5.. (blocks 1, 2)
    assert m.append_slots(1, 12) == [] and m.block_table(1) == [0, 1, 2, 0, 3, 4]
    assert m.slide_window(1, 24) == [1, 2, 0]       # keys from 17 on: blocks 4, 5 stay
    assert free_ids(m) == [1, 2, 0, 5] and m.stats().gpu_blocks_used == 2  # freed tail first
    with pytest.raises(ValueError, match="seq 1: 25 computed tokens but its 6 blocks"):
        m.slide_window(1, 25)


def test_released_cached_blocks_stay_findable_and_are_not_taken_again():
    m = KVCacheManager(8, block_size=4, watermark=0.0, sliding_window=8)
    tokens = list(range(20))
    m.allocate(1, tokens, 20)
    m.cache_blocks(1, tokens, 20)
    assert m.slide_window(1, 20) == [0, 1, 2]       # keys from 13 on: blocks 3, 4
    assert free_ids(m) == [5, 6, 7, 2, 1, 0]        # cached: to the tail, suffix first
    # A prompt sharing the whole prefix: the chain from block 0 still hits, but the blocks
    # before its first step's window are not taken (not revived, refcount stays 0).
    other = tokens + [99]
    assert m.lookup_prefix(other) == 20
    assert m.allocate(2, other, 1) == 20
    assert m.block_table(2) == [0, 1, 2, 3, 4, 5] and m.num_released_blocks(2) == 3
    assert refs(m, [0, 1, 2, 3, 4, 5]) == [0, 0, 0, 2, 2, 1]
    # Blocks filling later are cached as usual; a placeholder is never registered.
    assert m.append_slots(2, 3) == []
    m.cache_blocks(2, other + [1, 2, 3], 24)
    assert m.gpu_pool.blocks[5].block_hash is not None
    m.free(2)
    m.free(1)
    assert m.stats().gpu_blocks_used == 0 and m.lookup_prefix(other) == 20


def test_fork_shares_the_live_blocks_and_each_child_slides_on_its_own():
    m = KVCacheManager(8, block_size=4, watermark=0.0, sliding_window=8,
                       enable_prefix_caching=False)
    m.allocate(1, list(range(14)), 14)
    assert m.slide_window(1, 13) == [0]
    m.fork(1, 2)
    assert m.block_table(2) == [0, 1, 2, 3] and m.num_released_blocks(2) == 1
    assert refs(m, [0, 1, 2, 3]) == [0, 2, 2, 2]
    assert m.append_slots(1, 1) == [(3, 0)] and m.append_slots(2, 1) == []  # copy-on-write
    assert m.block_table(1) == [0, 1, 2, 0] and m.block_table(2) == [0, 1, 2, 3]
    assert m.slide_window(1, 15) == [1] and refs(m, [1]) == [1]   # the child still holds it
    assert m.slide_window(2, 15) == [1] and refs(m, [1]) == [0]
    m.free(1)
    m.free(2)
    assert m.stats().gpu_blocks_used == 0


def test_swap_moves_only_the_live_blocks():
    m = KVCacheManager(6, block_size=4, num_cpu_blocks=4, watermark=0.0, sliding_window=8,
                       enable_prefix_caching=False)
    m.allocate(1, list(range(18)), 18)
    assert m.slide_window(1, 18) == [0, 1]
    assert m.can_swap_out(1)
    assert m.swap_out(1) == [(2, 0), (3, 1), (4, 2)]
    assert m.block_table(1) == [0, 1, 0, 1, 2]       # placeholders stay, live part: host ids
    assert m.stats().gpu_blocks_used == 0 and m.stats().cpu_blocks_used == 3
    with pytest.raises(ValueError, match="swapped out; slide its window before swapping"):
        m.slide_window(1, 18)
    # The partial block is reused first; the full ones keep their link to the host copy.
    m.allocate(2, list(range(100, 112)), 12)
    assert m.block_table(2) == [4, 0, 1]
    assert m.can_swap_in(1)
    assert m.swap_in(1) == [(2, 5)]                   # device blocks 2 and 3 were intact
    assert m.block_table(1) == [0, 1, 2, 3, 5] and m.num_released_blocks(1) == 2
    m.free(1)
    m.free(2)
    assert m.stats().gpu_blocks_used == m.stats().cpu_blocks_used == 0


def test_drop_device_pool_keeps_a_swapped_windowed_sequence():
    m = KVCacheManager(6, block_size=4, num_cpu_blocks=4, watermark=0.0, sliding_window=8)
    m.allocate(1, list(range(18)), 18)
    m.slide_window(1, 18)
    m.swap_out(1)
    m.allocate(2, list(range(9)), 9)
    assert m.drop_device_pool() == [2]
    assert m.is_swapped(1) and m.num_released_blocks(1) == 2
    m.swap_in(1)
    assert m.num_released_blocks(1) == 2 and m.stats().gpu_blocks_used == 3
    assert all(0 <= b < 6 for b in m.block_table(1))
    m.free(1)
    assert m.stats().gpu_blocks_used == m.stats().cpu_blocks_used == 0


def test_bad_window_is_refused():
    with pytest.raises(ValueError, match="sliding_window must be >= 0"):
        KVCacheManager(4, block_size=4, sliding_window=-1)
