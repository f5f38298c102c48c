"""pagedserve/cluster_auth.py and cluster_net.py: the cluster secret, CURVE keys from it, a
wrong key refused and logged, and the addresses a multi-node group binds."""
from __future__ import annotations

import logging
import socket
import time

import pytest
import zmq

from pagedserve import cluster_auth, cluster_net, transport
from pagedserve.pipeline import messages
from pagedserve.pipeline.config import ClusterArgs, IpcArgs, ParallelArgs

WIRE = transport.Codec(transport.message_types(messages))  # reads every message


def write_secret(tmp_path, text=b"0123456789abcdef-secret", mode=0o600):
    path = tmp_path / "secret"
    path.write_bytes(text)
    path.chmod(mode)
    return str(path)


def test_the_secret_file_is_checked(tmp_path):
    assert cluster_auth.read_secret(write_secret(tmp_path, b"  0123456789abcdef\n")) == \
        b"0123456789abcdef"
    with pytest.raises(ValueError, match="open to other users"):
        cluster_auth.read_secret(write_secret(tmp_path, mode=0o644))
    with pytest.raises(ValueError, match="holds 5 bytes"):
        cluster_auth.read_secret(write_secret(tmp_path, b"short"))
    with pytest.raises(ValueError, match="No such file"):
        cluster_auth.read_secret(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="needs --cluster-secret-file"):
        cluster_auth.read_secret("")


def test_keys_are_the_secrets_and_only_its():
    a, b = cluster_auth.curve_keys(b"x" * 16), cluster_auth.curve_keys(b"y" * 16)
    assert a == cluster_auth.curve_keys(b"x" * 16)
    assert len({a.server_public, a.client_public, b.server_public, b.client_public}) == 4
    assert zmq.curve_public(a.server_secret) == a.server_public


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_only_a_peer_with_the_secret_gets_through_and_refusals_are_logged(caplog):
    addr = f"tcp://127.0.0.1:{_free_port()}"
    keys = cluster_auth.curve_keys(b"the cluster's own secret")
    ctx = zmq.Context()
    server = transport.make_socket(ctx, zmq.ROUTER, addr, bind=True,
                                   secure=cluster_auth.curve_server(keys))
    log = logging.getLogger("test.cluster_auth")
    cluster_auth.log_refusals(server, addr, log)
    wrong = cluster_auth.curve_client(cluster_auth.curve_keys(b"somebody else's secret"))
    peers = {name: transport.make_socket(ctx, zmq.DEALER, addr, bind=False, identity=name,
                                         secure=secure)
             for name, secure in ((b"good", cluster_auth.curve_client(keys)),
                                  (b"wrong-key", wrong), (b"plain", None))}
    try:
        with caplog.at_level(logging.INFO, logger="test.cluster_auth"):
            for sock in peers.values():
                sock.setsockopt(zmq.SNDTIMEO, 3000)
            transport.send(peers[b"good"], messages.Heartbeat("worker", 1))
            for name in (b"wrong-key", b"plain"):
                try:
                    transport.send(peers[name], messages.Heartbeat("worker", 2), flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass       # no connected peer to queue it for: the handshake failed
            assert server.poll(5000)
            sender, msg = WIRE.recv_routed(server)
            assert (sender, msg) == (b"good", messages.Heartbeat("worker", 1))
            assert not server.poll(1500)             # nothing from the others
            deadline = time.monotonic() + 5
            while "refused" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.05)
        assert "authenticated a connection on " + addr in caplog.text
        assert "refused" in caplog.text and "a peer without the cluster secret" in caplog.text
        assert "zmtp_" in caplog.text                # the handshake's own reason
    finally:
        for sock in (*peers.values(), server):
            sock.close(0)
        cluster_auth.stop_allow_list(ctx)
        ctx.term()                                  # returns: the monitor thread let go


def test_a_client_key_off_the_allow_list_is_refused_even_with_the_servers_key():
    """ZAP: a peer that learned the server's public key but holds another client key pair
    completes no handshake; the cluster's client key does."""
    addr = f"tcp://127.0.0.1:{_free_port()}"
    keys = cluster_auth.curve_keys(b"the cluster's own secret")
    ctx = zmq.Context()
    server = transport.make_socket(ctx, zmq.ROUTER, addr, bind=True,
                                   secure=cluster_auth.curve_server(keys))
    stranger_public, stranger_secret = zmq.curve_keypair()

    def stranger(sock):
        sock.curve_serverkey = keys.server_public
        sock.curve_publickey, sock.curve_secretkey = stranger_public, stranger_secret
    peers = [transport.make_socket(ctx, zmq.DEALER, addr, bind=False, identity=name,
                                   secure=secure)
             for name, secure in ((b"stranger", stranger),
                                  (b"good", cluster_auth.curve_client(keys)))]
    try:
        for sock in peers:
            sock.setsockopt(zmq.SNDTIMEO, 3000)
        try:
            transport.send(peers[0], messages.Heartbeat("worker", 2), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass
        transport.send(peers[1], messages.Heartbeat("worker", 1))
        assert server.poll(5000)
        assert WIRE.recv_routed(server) == (b"good", messages.Heartbeat("worker", 1))
        assert not server.poll(1500)
        allow_list = cluster_auth.allow_only(ctx, keys.client_public)
        assert allow_list.refused >= 1 and allow_list.allowed == {keys.client_public}
    finally:
        for sock in (*peers, server):
            sock.close(0)
        cluster_auth.stop_allow_list(ctx)
        ctx.term()


def test_ipc_addresses_need_no_secret():
    assert cluster_auth.for_address("ipc:///tmp/x.sock", "", server=True) is None


def test_the_master_binds_its_own_address_and_names_the_interface(tmp_path):
    cluster = ClusterArgs(nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=29555,
                          cluster_secret_file=write_secret(tmp_path))
    two = ParallelArgs(tensor_parallel_size=2)
    ipc = IpcArgs(plan_addr="ipc:///x/plan.sock")
    assert cluster_net.configure(cluster, two, ipc) == "lo"
    assert (ipc.dist_init_addr, ipc.plan_addr) == ("tcp://127.0.0.1:29555", "tcp://127.0.0.1:29556")
    assert list(cluster.local_ranks(2)) == [0]
    far = ClusterArgs(nnodes=2, master_addr="192.0.2.7",
                      cluster_secret_file=cluster.cluster_secret_file)
    with pytest.raises(ValueError, match="is not an address of this host"):
        cluster_net.configure(far, two, IpcArgs())
    with pytest.raises(ValueError, match="does not split evenly"):
        cluster_net.configure(cluster, ParallelArgs(tensor_parallel_size=3), IpcArgs())
    assert cluster_net.configure(ClusterArgs(), two, IpcArgs()) is None


def test_multinode_settings_are_checked():
    with pytest.raises(ValueError, match="needs --master-addr"):
        ClusterArgs(nnodes=2)
    with pytest.raises(ValueError, match="--node-rank"):
        ClusterArgs(nnodes=2, node_rank=2, master_addr="h")
    assert list(ClusterArgs(nnodes=2, node_rank=1, master_addr="h").local_ranks(4)) == [2, 3]
    assert list(ClusterArgs().local_ranks(3)) == [0, 1, 2]


def test_cpu_threads_split_the_cores_of_this_host_only(monkeypatch):
    from pagedserve.pipeline import config
    monkeypatch.setattr(config, "_usable_cores", lambda: 8)
    parallel = ParallelArgs(tensor_parallel_size=4)
    assert parallel.threads_per_rank() == 2                  # one host holds all 4 ranks
    ranks_here = len(ClusterArgs(nnodes=2, master_addr="h").local_ranks(4))
    assert parallel.threads_per_rank(ranks_here) == 4        # 2 of the 4 on each of 2 hosts
    assert ParallelArgs(tensor_parallel_size=4, cpu_threads=3).threads_per_rank(2) == 3


def test_a_node_other_than_0_runs_only_its_worker_ranks(tmp_path):
    from pagedserve.pipeline import launch
    from pagedserve.pipeline.config import EngineConfig
    cfg = EngineConfig.from_kwargs(tensor_parallel_size=4, nnodes=2, node_rank=1,
                                   master_addr="127.0.0.1", master_port=29555,
                                   cluster_secret_file=write_secret(tmp_path),
                                   ipc_dir=str(tmp_path / "ipc"))
    cfg.ipc.fill_defaults()
    supervisor = launch.Supervisor(cfg)
    try:
        assert [c.name for c in supervisor.children] == ["worker2", "worker3"]
        assert supervisor.headless and supervisor.node_interface == "lo"
        assert cfg.ipc.plan_addr == "tcp://127.0.0.1:29556"
    finally:
        supervisor._cleanup()
