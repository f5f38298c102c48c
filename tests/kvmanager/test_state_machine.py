"""Random allocate / append / fork / free / abort / swap / prefix-hit runs against a model that
also plays the workers: it writes every token into the slot the block tables name and applies
the copy-on-write and swap mappings, so a wrong share or a wrong mapping shows up as a sequence
reading back the wrong tokens."""

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedserve.kvmanager import KVCacheManager, NoFreeBlocksError, SharedBlockTables, hash_full_blocks

BS = 4
NUM_GPU, NUM_CPU, MAX_SEQS = 16, 8, 10
BASES = [list(range(100, 140)), list(range(200, 240)), [7] * 40]


class _Seq:
    def __init__(self, known, filled, salt):
        self.known, self.filled, self.salt = known, filled, salt


class KVManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.tables = SharedBlockTables(MAX_SEQS, NUM_GPU)
        self.m = KVCacheManager(NUM_GPU, BS, NUM_CPU, block_tables=self.tables, watermark=0.1)
        self.seqs: dict[int, _Seq] = {}
        self.next_id = 0
        self.content = {"gpu": {}, "cpu": {}}  # block id -> list of BS slots (None = garbage)
        self.history: list[list[int]] = []
        self.holding = False
        self.held: dict[int, list[int]] = {}  # row -> its entries when its sequence was freed

    def teardown(self):
        self.tables.close()

    # ---- the "worker" side -------------------------------------------------------------

    def _pool_of(self, seq_id):
        return "cpu" if self.m.is_swapped(seq_id) else "gpu"

    def _write(self, seq_id, start, stop):
        seq, table = self.seqs[seq_id], self.m.block_table(seq_id)
        for pos in range(start, stop):
            self.content["gpu"].setdefault(table[pos // BS], [None] * BS)[pos % BS] = \
                seq.known[pos]

    def _wipe(self, pool, block_ids):
        for b in block_ids:
            self.content[pool][b] = [None] * BS

    def _copy(self, src_pool, dst_pool, pairs):
        for src, dst in pairs:
            self.content[dst_pool][dst] = list(self.content[src_pool][src])

    def snapshot(self):
        m = self.m
        return (
            [b.block_id for b in m.gpu_pool.free_block_queue],
            [b.block_id for b in m.cpu_pool.free_block_queue],
            [(b.ref_cnt, b.block_hash, b.swap_copy) for b in m.gpu_pool.blocks],
            [(b.ref_cnt, b.swap_copy) for b in m.cpu_pool.blocks],
            {h: b.block_id for h, b in m.gpu_pool.cached_blocks.items()},
            {s: (m.block_table(s), m.num_tokens(s), m.is_swapped(s)) for s in m.seq_ids()},
            m.stats(), self.tables.array.tolist(),
        )

    # ---- rules -------------------------------------------------------------------------

    def _allocate(self, prompt, chunk, salt):
        seq_id, self.next_id = self.next_id, self.next_id + 1
        expect_cached = self.m.lookup_prefix(prompt, salt)
        assert expect_cached % BS == 0 and expect_cached < len(prompt)
        num_new = max(1, min(chunk, len(prompt) - expect_cached))
        before = self.snapshot()
        cached = self.m.allocate(seq_id, prompt, num_new, cache_salt=salt)
        if cached is None:
            assert self.snapshot() == before
            pool = self.m.gpu_pool
            revived = sum(pool.cached_blocks[h].ref_cnt == 0
                          for h in hash_full_blocks(prompt[:expect_cached], BS, salt))
            fresh = -(-(expect_cached + num_new) // BS) - expect_cached // BS
            assert fresh + revived > pool.num_free_blocks
            event("allocate failed")
            return
        assert cached == expect_cached
        event("prefix hit" if cached else "prefix miss")
        self.seqs[seq_id] = _Seq(list(prompt), cached + num_new, salt)
        self.history.append(list(prompt))
        table = self.m.block_table(seq_id)
        assert len(table) == -(-(cached + num_new) // BS)
        self._wipe("gpu", table[cached // BS:])
        self._write(seq_id, cached, cached + num_new)
        self.m.cache_blocks(seq_id, prompt, cached + num_new)

    @precondition(lambda self: len(self.seqs) + len(self.held) < MAX_SEQS)
    @rule(base=st.integers(0, len(BASES) - 1), length=st.integers(1, 24),
          tail=st.lists(st.integers(0, 9), max_size=6), chunk=st.integers(1, 30),
          salt=st.sampled_from([None, None, "s"]))
    def allocate(self, base, length, tail, chunk, salt):
        self._allocate(BASES[base][:length] + tail, chunk, salt)

    @precondition(lambda self: len(self.seqs) + len(self.held) < MAX_SEQS and self.history)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 9), min_size=1, max_size=3),
          chunk=st.integers(1, 30))
    def prefix_hit(self, data, extra, chunk):
        prev = data.draw(st.sampled_from(self.history))
        cut = data.draw(st.integers(0, len(prev)))
        self._allocate(prev[:cut] + extra, chunk, None)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), k=st.integers(1, 6))
    def append(self, data, k):
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        seq = self.seqs[seq_id]
        if self.m.is_swapped(seq_id):
            with pytest.raises(ValueError, match="swapped out"):
                self.m.append_slots(seq_id, k)
            return
        before = self.snapshot()
        need = self.m.num_blocks_to_append(seq_id, k)
        copies = self.m.append_slots(seq_id, k)
        if copies is None:
            assert self.snapshot() == before and need > self.m.num_free_blocks
            event("append failed")
            return
        old_len = len(self.m.block_table(seq_id)) - (need - len(copies))
        assert len(copies) <= 1
        event("copy-on-write" if copies else "append in place")
        self._copy("gpu", "gpu", copies)
        self._wipe("gpu", self.m.block_table(seq_id)[old_len:])
        self._fill(data, seq_id, seq, k)

    def _fill(self, data, seq_id, seq, k):
        """Write k more sampled tokens into the sequence's new slots and cache its full blocks."""
        while len(seq.known) < seq.filled + k:
            seq.known.append(data.draw(st.integers(0, 9), label="sampled token"))
        self._write(seq_id, seq.filled, seq.filled + k)
        seq.filled += k
        self.m.cache_blocks(seq_id, seq.known, seq.filled)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), k=st.integers(0, 6))
    def reserve(self, data, k):
        """The decode fast path: growth without copy-on-write, new block ids returned."""
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        seq = self.seqs[seq_id]
        if self.m.is_swapped(seq_id):
            with pytest.raises(ValueError, match="swapped out"):
                self.m.reserve_slots(seq_id, self.m.num_tokens(seq_id) + k)
            return
        before = self.snapshot()
        old_table = self.m.block_table(seq_id)
        need = self.m.num_blocks_to_append(seq_id, k)
        new_ids = self.m.reserve_slots(seq_id, self.m.num_tokens(seq_id) + k)
        if new_ids is None:
            assert self.snapshot() == before
            cow = need > -(-(self.m.num_tokens(seq_id) + k) // BS) - len(old_table)
            assert cow or need > self.m.num_free_blocks
            event("reserve deferred: copy-on-write" if cow else "reserve failed")
            return
        assert self.m.block_table(seq_id) == old_table + new_ids and len(new_ids) == need
        event("reserve new block" if new_ids else "reserve in place")
        self._wipe("gpu", new_ids)
        self._fill(data, seq_id, seq, k)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), k=st.integers(0, 4))
    def commit(self, data, k):
        """The scheduler's update path: slots reserved lazily inside its blocks, then cached."""
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        seq = self.seqs[seq_id]
        if self.m.is_swapped(seq_id):
            with pytest.raises(ValueError, match="swapped out"):
                self.m.commit_blocks([(seq_id, seq.known, seq.filled + k, seq.filled)])
            return
        before = self.snapshot()
        fits = self.m.num_blocks_to_append(seq_id, k) == 0
        while len(seq.known) < seq.filled + k:
            seq.known.append(data.draw(st.integers(0, 9), label="sampled token"))
        if not fits:
            with pytest.raises(RuntimeError, match="needs a block or a copy"):
                self.m.commit_blocks([(seq_id, seq.known, seq.filled + k, seq.filled + k)])
            assert self.snapshot() == before
            event("commit refused")
            return
        self._write(seq_id, seq.filled, seq.filled + k)
        seq.filled += k
        self.m.commit_blocks([(seq_id, seq.known, seq.filled, seq.filled)])
        assert self.m.num_tokens(seq_id) == seq.filled
        event("commit")

    @precondition(lambda self: self.seqs and len(self.seqs) + len(self.held) < MAX_SEQS)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.seqs)))
        child, self.next_id = self.next_id, self.next_id + 1
        if self.m.is_swapped(parent):
            with pytest.raises(ValueError, match="swapped out"):
                self.m.fork(parent, child)
            return
        self.m.fork(parent, child)
        p = self.seqs[parent]
        self.seqs[child] = _Seq(list(p.known), p.filled, p.salt)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), abort=st.booleans())
    def free(self, data, abort):
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        row = self.m.row_of(seq_id)
        if self.holding:  # a plan naming it may be in flight: its row must stay readable
            self.held[row] = self.tables.array[row].tolist()
        self.m.free(seq_id)  # abort is a free
        del self.seqs[seq_id]
        with pytest.raises(KeyError, match="not allocated"):
            self.m.free(seq_id)

    @rule(holding=st.booleans())
    def hold_rows(self, holding):
        """A plan goes out (hold) or the next schedule starts (release)."""
        self.m.hold_rows(holding)
        self.holding = holding
        if not holding:
            self.held.clear()

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def swap_out(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        if self.m.is_swapped(seq_id):
            return
        before = self.snapshot()
        if not self.m.can_swap_out(seq_id):
            with pytest.raises(NoFreeBlocksError):
                self.m.swap_out(seq_id)
            assert self.snapshot() == before
            return
        pairs = self.m.swap_out(seq_id)
        event("swap_out reused a copy" if len(pairs) < len(self.m.block_table(seq_id))
              else "swap_out copied all")
        self._copy("gpu", "cpu", pairs)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def swap_in(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        if not self.m.is_swapped(seq_id):
            return
        before = self.snapshot()
        try:
            pairs = self.m.swap_in(seq_id)
        except NoFreeBlocksError:
            assert self.snapshot() == before and not self.m.can_swap_in(seq_id)
            event("swap_in failed")
            return
        event("swap_in reused a copy" if len(pairs) < len(self.m.block_table(seq_id))
              else "swap_in copied all")
        self._copy("cpu", "gpu", pairs)

    # ---- invariants --------------------------------------------------------------------

    @invariant()
    def pools_are_consistent(self):
        for pool in (self.m.gpu_pool, self.m.cpu_pool):
            queued = [b.block_id for b in pool.free_block_queue]
            assert len(queued) == len(set(queued)) == pool.num_free_blocks
            assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
            for b in pool.blocks:
                assert b.ref_cnt >= 0
                assert (b.ref_cnt == 0) == b.is_free  # never free and referenced

    @invariant()
    def refcounts_match_block_tables(self):
        counts = {"gpu": [0] * NUM_GPU, "cpu": [0] * NUM_CPU}
        for seq_id in self.m.seq_ids():
            for b in self.m.block_table(seq_id):
                counts[self._pool_of(seq_id)][b] += 1
        assert counts["gpu"] == [b.ref_cnt for b in self.m.gpu_pool.blocks]
        assert counts["cpu"] == [b.ref_cnt for b in self.m.cpu_pool.blocks]

    @invariant()
    def prefix_cache_is_a_bijection_over_full_blocks(self):
        pool = self.m.gpu_pool
        for h, b in pool.cached_blocks.items():
            assert b.block_hash == h
            assert None not in self.content["gpu"][b.block_id]  # only full blocks are cached
        assert sum(b.block_hash is not None for b in pool.blocks) == len(pool.cached_blocks)
        for seq_id, seq in self.seqs.items():
            if self.m.is_swapped(seq_id):
                continue
            want = hash_full_blocks(seq.known[:seq.filled], BS, seq.salt)
            for i, b in enumerate(self.m.block_table(seq_id)):
                h = pool.blocks[b].block_hash
                assert h is None or (i < len(want) and h == want[i])

    @invariant()
    def every_sequence_reads_back_its_tokens(self):
        for seq_id, seq in self.seqs.items():
            pool, table = self._pool_of(seq_id), self.m.block_table(seq_id)
            assert self.m.num_tokens(seq_id) == seq.filled
            assert len(table) == -(-seq.filled // BS)
            got = [self.content[pool][table[p // BS]][p % BS] for p in range(seq.filled)]
            assert got == seq.known[:seq.filled]

    @invariant()
    def swap_links_are_symmetric(self):
        gpu, cpu = self.m.gpu_pool.blocks, self.m.cpu_pool.blocks
        for b in gpu:
            assert b.swap_copy is None or cpu[b.swap_copy].swap_copy == b.block_id
        for b in cpu:
            assert b.swap_copy is None or gpu[b.swap_copy].swap_copy == b.block_id

    @invariant()
    def shared_rows_mirror_block_tables(self):
        used_rows = set()
        for seq_id in self.m.seq_ids():
            row = self.m.row_of(seq_id)
            used_rows.add(row)
            want = [] if self.m.is_swapped(seq_id) else self.m.block_table(seq_id)
            assert self.tables.array[row].tolist() == want + [-1] * (NUM_GPU - len(want))
        assert not used_rows & set(self.held)  # a held row is handed to no one
        for row, entries in self.held.items():
            assert self.tables.array[row].tolist() == entries
        for row in set(range(MAX_SEQS)) - used_rows - set(self.held):
            assert (self.tables.array[row] == -1).all()

    @invariant()
    def nothing_in_use_without_sequences(self):
        if not self.seqs:
            assert self.m.gpu_pool.num_used_blocks == 0 and self.m.cpu_pool.num_used_blocks == 0
            assert self.m.usage == 0.0


KVManagerMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestKVManagerMachine = KVManagerMachine.TestCase
