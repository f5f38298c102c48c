import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pagedserve.kvmanager import KVCacheManager, SharedBlockTables
from pagedserve.shm_tables import NAME_PREFIX

ROOT = Path(__file__).resolve().parents[2]


def our_segments():
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(NAME_PREFIX))


@pytest.fixture
def tables():
    t = SharedBlockTables(4, 6)
    try:
        yield t
    finally:
        t.close()
    assert not os.path.exists(f"/dev/shm/{t.name}")


def test_owner_creates_filled_with_minus_one_and_close_unlinks():
    t = SharedBlockTables(3, 5)
    try:
        assert t.name.startswith(NAME_PREFIX) and os.path.exists(f"/dev/shm/{t.name}")
        assert t.array.shape == (3, 5) and t.array.dtype == np.int32
        assert (t.array == -1).all()
    finally:
        t.close()
    assert not os.path.exists(f"/dev/shm/{t.name}")
    t.close()  # idempotent


def test_attach_reads_what_the_owner_wrote_and_is_read_only(tables):
    tables.array[1, :3] = [7, 8, 9]
    reader = SharedBlockTables.attach(tables.name, 4, 6)
    try:
        assert reader.array[1].tolist() == [7, 8, 9, -1, -1, -1]
        assert not reader.array.flags.writeable
        with pytest.raises(ValueError):
            reader.array[0, 0] = 1
        tables.array[2, 0] = 42  # the same memory, no copy
        assert reader.array[2, 0] == 42
        with pytest.raises(PermissionError, match="only the owner"):
            reader.unlink()
    finally:
        reader.close()
    assert os.path.exists(f"/dev/shm/{tables.name}")  # a reader never unlinks


def test_attach_errors_name_the_cause(tables):
    with pytest.raises(FileNotFoundError, match="no shared block tables named 'nope_x'"):
        SharedBlockTables.attach("nope_x", 4, 6)
    with pytest.raises(ValueError, match="fewer than the"):
        SharedBlockTables.attach(tables.name, 40, 6)
    with pytest.raises(ValueError, match="must be positive"):
        SharedBlockTables(0, 3)


READER = """
import json, sys
from pagedserve.kvmanager import SharedBlockTables
t = SharedBlockTables.attach(sys.argv[1], 4, 6)
print(json.dumps(t.array.tolist()))
t.close()
"""


@pytest.mark.slow
def test_second_process_reads_manager_rows_by_name():
    before = our_segments()
    tables = SharedBlockTables(4, 6)
    try:
        m = KVCacheManager(16, block_size=4, block_tables=tables, watermark=0.0)
        m.allocate(10, list(range(9)), 9)
        m.allocate(11, [5] * 4, 4)
        m.fork(10, 12)
        m.append_slots(12, 1)
        m.free(11)
        out = subprocess.run([sys.executable, "-c", READER, tables.name], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stderr == ""  # no resource_tracker warning from the reader
        assert json.loads(out.stdout) == tables.array.tolist()
        rows = json.loads(out.stdout)
        assert rows[m.row_of(10)] == [0, 1, 2, -1, -1, -1]
        assert rows[m.row_of(12)] == [0, 1, 4, -1, -1, -1]
        assert os.path.exists(f"/dev/shm/{tables.name}")  # the reader's exit left it alone
    finally:
        tables.close()
    assert our_segments() == before


def test_manager_keeps_rows_in_sync(tables):
    m = KVCacheManager(12, block_size=4, num_cpu_blocks=4, block_tables=tables, watermark=0.0)
    assert m.allocate(1, list(range(6)), 6) == 0
    r1 = m.row_of(1)
    assert r1 == 0 and tables.array[r1].tolist() == [0, 1, -1, -1, -1, -1]
    m.allocate(2, [3] * 3, 3)
    assert m.row_of(2) == 1
    m.fork(1, 3)
    assert tables.array[m.row_of(3)].tolist() == [0, 1, -1, -1, -1, -1]
    assert m.append_slots(3, 3) == [(1, 3)]
    assert tables.array[m.row_of(3)].tolist() == [0, 3, 4, -1, -1, -1]
    m.swap_out(1)
    assert tables.array[r1].tolist() == [-1] * 6 and m.row_of(1) == r1
    m.swap_in(1)
    assert tables.array[r1].tolist() == m.block_table(1) + [-1] * 4
    m.free(2)
    assert tables.array[1].tolist() == [-1] * 6
    m.allocate(4, [1], 1)
    assert m.row_of(4) == 1
    m.allocate(5, [1], 1)
    with pytest.raises(RuntimeError, match="all 4 block-table rows are in use"):
        m.allocate(6, [1], 1)
    assert 6 not in m
    with pytest.raises(ValueError, match="hold at most 6 per sequence"):
        m.append_slots(4, 24)
    assert m.num_tokens(4) == 1
    for seq_id in m.seq_ids():
        m.free(seq_id)
    assert (tables.array == -1).all()


def test_held_rows_keep_their_blocks_until_released(tables):
    m = KVCacheManager(12, block_size=4, block_tables=tables, watermark=0.0)
    m.allocate(1, list(range(6)), 6)
    m.allocate(2, [3] * 3, 3)
    row1 = m.row_of(1)
    m.hold_rows(True)                      # a plan naming seq 1 is in flight
    m.free(1)                              # its abort arrives meanwhile
    assert 1 not in m and tables.array[row1].tolist() == [0, 1, -1, -1, -1, -1]
    m.allocate(3, [9], 1)
    assert m.row_of(3) != row1             # the held row is not handed out
    assert m.num_free_blocks == 12 - 2     # the blocks themselves are free at once
    m.hold_rows(False)                     # the step is over
    assert tables.array[row1].tolist() == [-1] * 6
    m.allocate(4, [9, 9], 2)
    assert m.row_of(4) == row1             # and the row is reused
    row2 = m.row_of(2)
    m.free(2)                              # not holding: cleared at once
    assert tables.array[row2].tolist() == [-1] * 6
