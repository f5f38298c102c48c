"""The launcher removes exactly what its group created, and nothing another group made - even
one whose names start with this group's."""
from __future__ import annotations

import os
from multiprocessing import shared_memory

from pagedserve.pipeline.config import EngineConfig
from pagedserve.pipeline.launch import Supervisor


def test_cleanup_removes_only_this_groups_files_and_segments(tmp_path):
    config = EngineConfig.from_kwargs(ipc_dir=str(tmp_path / "g"), http=False,
                                      tensor_parallel_size=2)
    config.ipc.fill_defaults()
    sup = Supervisor(config)  # binds its control socket in the ipc folder
    ipc = config.ipc
    assert ipc.owns_dir and ipc.dist_init_addr == ipc.rendezvous(0)
    ours = [shared_memory.SharedMemory(name, create=True, size=64)
            for name in ipc.shm_segments(2)]
    others = [shared_memory.SharedMemory(name, create=True, size=64)
              for name in (f"{ipc.tag}x_bt", f"{ipc.tag}_swap11")]  # our names are prefixes
    for path in (ipc.socket_path("frontend"), tmp_path / "g" / "rendezvous-0"):
        open(path, "w").close()
    try:
        sup._cleanup()
        assert not os.path.exists(tmp_path / "g")
        assert all(not os.path.exists(f"/dev/shm/{s.name}") for s in ours)
        assert all(os.path.exists(f"/dev/shm/{s.name}") for s in others)
    finally:
        for s in ours + others:
            s.close()
            try:
                s.unlink()
            except FileNotFoundError:
                pass


def test_a_given_ipc_dir_keeps_what_is_not_ours(tmp_path):
    given = tmp_path / "given"
    given.mkdir(mode=0o700)
    (given / "notes.txt").write_text("someone else's")
    config = EngineConfig.from_kwargs(ipc_dir=str(given), http=False)
    config.ipc.fill_defaults()
    assert not config.ipc.owns_dir
    Supervisor(config)._cleanup()
    assert sorted(os.listdir(given)) == ["notes.txt"]
