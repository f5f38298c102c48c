"""workers/distributed.bound_tcp_store: rank 0 listens on the given address only, and a rank
that finds a sealed store (a group already formed) waits for a new one instead of joining."""
from __future__ import annotations

import datetime
import socket

import psutil
import pytest

from pagedserve.workers.distributed import SEALED_KEY, bound_tcp_store


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rank0_binds_the_address_and_a_sealed_store_is_not_joined():
    port = _free_port()
    url = f"tcp://127.0.0.1:{port}"
    short = datetime.timedelta(seconds=2)
    master = bound_tcp_store(url, 0, 2, datetime.timedelta(seconds=30))
    listening = {c.laddr for c in psutil.Process().net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN}
    assert ("127.0.0.1", port) in listening
    assert not any(addr.port == port and addr.ip in ("0.0.0.0", "::") for addr in listening)

    client = bound_tcp_store(url, 1, 2, short)      # open: joins
    client.set("from-rank-1", "x")
    assert master.get("from-rank-1") == b"x"
    master.set(SEALED_KEY, "1")
    with pytest.raises(TimeoutError, match="stayed sealed"):
        bound_tcp_store(url, 1, 2, short)
