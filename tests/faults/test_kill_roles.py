"""SIGKILL each role mid-stream: every request completes exactly as without the fault."""
from __future__ import annotations

import time

import pytest

from faults.conftest import Group, token_ids

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tp2_group(model_dir, prompt_ids):
    group = Group(model_dir, tp=2)
    reference = token_ids(group.submit_all(prompt_ids))
    assert all(len(r) == 20 for r in reference)
    yield group, reference
    assert group.close() == 0
    assert group.leftovers() == []


# (worker1, a rank other than 0, is killed on its own host in
# tests/e2e/test_multihost_tp.py::test_a_worker_killed_on_the_remote_host_recovers)
@pytest.mark.parametrize("role", ["worker0", "detokenizer", "scheduler"])
def test_sigkill_mid_stream_loses_nothing(tp2_group, prompt_ids, role):
    group, reference = tp2_group
    counted = "worker" if role.startswith("worker") else role
    restarts_before = group.restarts().get(counted, 0)
    before = group.client.stats()["generation_tokens"]
    futures = group.submit_all(prompt_ids)
    group.wait_tokens(before + 32 * 4)  # every stream is under way
    killed = group.kill(role)
    assert not all(f.done() for f in futures)  # the kill hit streams in flight
    assert token_ids(futures) == reference
    assert group.wait_restarted(role, killed) != killed
    # the scheduler counts the restart (a restarted scheduler counts its own incarnation)
    restarts = group.restarts()
    assert restarts.get(counted, 0) == (1 if role == "scheduler" else restarts_before + 1)
    assert group.blocks_in_use() == 0


def test_swapped_sequences_survive_a_worker_restart(model_dir, prompt_ids):
    """A small device pool forces swap-outs; killing the worker keeps the host swap pool (it is
    shared memory) and every request still completes as it did without the fault."""
    group = Group(model_dir, extra=("--kv-cache-memory", "30MiB", "--preemption-mode", "swap"))
    try:
        reference = token_ids(group.submit_all(prompt_ids))
        assert group.client.stats()["num_preemptions"] > 0
        futures = group.submit_all(prompt_ids)
        deadline = time.monotonic() + 300
        # Kill once a swap-out is done (a later step has completed), not while it is in flight.
        seen_at = None
        while True:
            stats = group.client.stats()
            assert time.monotonic() < deadline, "nothing stayed swapped out"
            if stats["num_requests_swapped"] == 0:
                seen_at = None
            elif seen_at is None:
                seen_at = stats["generation_tokens"]
            elif stats["generation_tokens"] > seen_at:
                break
            time.sleep(0.01)
        killed = group.kill("worker0")
        assert token_ids(futures) == reference
        group.wait_restarted("worker0", killed)
        assert group.restarts()["worker"] == 1
        assert group.blocks_in_use() == 0
        assert group.client.stats()["cpu_blocks_used"] == 0
    finally:
        assert group.close() == 0
    assert group.leftovers() == []


def test_the_group_listens_on_loopback_only(tp2_group):
    """No socket of a one-host group (TP rendezvous, gloo's pairs, ZeroMQ) listens on a
    public address: the rendezvous is a file in the 0700 ipc folder, gloo is pinned to lo."""
    import psutil
    group, _ = tp2_group
    procs = [psutil.Process(group.proc.pid), *psutil.Process(group.proc.pid).children()]
    listening = [(p.pid, c.laddr.ip, c.laddr.port) for p in procs
                 for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    assert all(ip in ("127.0.0.1", "::1") for _, ip, _ in listening), listening
