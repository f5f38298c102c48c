"""A worker's shared swap pool (workers/kv_cache.py) and the scheduler's block tables
(pagedserve/shm_tables.py): a name no other user can derive, created exclusively with mode 0600,
and attached (by a restarted worker; by every worker for the tables) only when it is still ours
and private: a segment planted under the name, or opened to others, is refused."""
from __future__ import annotations

import os
import stat

import pytest
import torch

from pagedserve.shm_tables import SharedBlockTables
from pagedserve.pipeline.config import IpcArgs
from pagedserve.private_files import PrivateFileError
from pagedserve.workers.kv_cache import allocate_swap_pool

KV_CACHE = torch.zeros(2, 2, 4, 16, 1, 8)   # [layers, K/V, blocks, block size, heads, dim]
POOL_BYTES = 2 * 2 * 3 * 16 * 1 * 8 * 4     # the same with 3 blocks, fp32


@pytest.fixture
def segment(tmp_path):
    """The name rank 0's pool takes in a group whose ipc folder is tmp_path/ipc."""
    name = IpcArgs(ipc_dir=str(tmp_path / "ipc")).swap_segment(0)
    yield name
    try:
        os.unlink(f"/dev/shm/{name}")
    except FileNotFoundError:
        pass


def _plant(name: str, mode: int) -> None:
    """What another user would do: a segment of the right size under the name."""
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
    os.fchmod(fd, mode)  # exactly `mode`, whatever the umask
    os.ftruncate(fd, POOL_BYTES)
    os.close(fd)


def test_names_hold_a_random_part_so_no_one_derives_them(tmp_path):
    ipc = str(tmp_path / "ipc")
    first, second = IpcArgs(ipc_dir=ipc), IpcArgs(ipc_dir=ipc)
    assert first.tag == second.tag  # the folder's part, that the router reaps by
    assert first.swap_segment(0) != second.swap_segment(0)
    assert first.block_tables_segment != second.block_tables_segment


def test_the_pool_is_created_0600_and_a_restarted_worker_attaches_to_it(segment):
    pool = allocate_swap_pool(KV_CACHE, 3, segment)
    info = os.stat(f"/dev/shm/{segment}")
    assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.getuid()
    assert info.st_size == POOL_BYTES
    pool[1, 0, 2, 5, 0, 3] = 7.0
    again = allocate_swap_pool(KV_CACHE, 3, segment)  # what a restart does
    assert again[1, 0, 2, 5, 0, 3].item() == 7.0


def test_a_segment_planted_open_to_others_is_refused(segment):
    _plant(segment, 0o666)
    with pytest.raises(PrivateFileError, match=r"open to other users \(mode 0666\)"):
        allocate_swap_pool(KV_CACHE, 3, segment)


def test_a_segment_of_another_user_is_refused(segment, monkeypatch):
    _plant(segment, 0o600)
    if os.getuid() == 0:  # root can hand it to another user for real
        os.chown(f"/dev/shm/{segment}", 65534, 65534)
    else:  # the file is ours: look at it as if we were someone else
        real = os.getuid()
        monkeypatch.setattr(os, "getuid", lambda: real + 1)
    with pytest.raises(PrivateFileError, match="belongs to uid"):
        allocate_swap_pool(KV_CACHE, 3, segment)


# -- the scheduler's block tables (pagedserve/shm_tables.py): workers attach read-only ----------
def _plant_tables(name: str, mode: int) -> None:
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
    os.fchmod(fd, mode)
    os.ftruncate(fd, 4 * 8 * 4)  # [4, 8] int32: the size the attach asks for
    os.close(fd)


@pytest.fixture
def tables_segment(tmp_path):
    name = IpcArgs(ipc_dir=str(tmp_path / "ipc")).block_tables_segment
    yield name
    try:
        os.unlink(f"/dev/shm/{name}")
    except FileNotFoundError:
        pass


def test_block_tables_are_created_0600_exclusively_and_attach(tables_segment):
    with SharedBlockTables(4, 8, name=tables_segment) as owner:
        info = os.stat(f"/dev/shm/{tables_segment}")
        assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.getuid()
        with pytest.raises(FileExistsError):  # never adopts a segment already there
            SharedBlockTables(4, 8, name=tables_segment)
        owner.array[1, 2] = 5
        reader = SharedBlockTables.attach(tables_segment, 4, 8)
        assert reader.array[1, 2] == 5
        reader.close()


def test_block_tables_planted_open_to_others_are_refused_on_attach(tables_segment):
    _plant_tables(tables_segment, 0o644)
    with pytest.raises(PrivateFileError, match=r"shared block tables .* open to other users "
                                               r"\(mode 0644\)"):
        SharedBlockTables.attach(tables_segment, 4, 8)


def test_block_tables_of_another_user_are_refused_on_attach(tables_segment, monkeypatch):
    _plant_tables(tables_segment, 0o600)
    if os.getuid() == 0:
        os.chown(f"/dev/shm/{tables_segment}", 65534, 65534)
    else:
        real = os.getuid()
        monkeypatch.setattr(os, "getuid", lambda: real + 1)
    with pytest.raises(PrivateFileError, match="belongs to uid"):
        SharedBlockTables.attach(tables_segment, 4, 8)
