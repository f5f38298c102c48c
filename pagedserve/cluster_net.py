"""Addresses of a multi-node group (`--nnodes`, `--node-rank`, `--master-addr`,
`--master-port`, torchrun's names): what each node binds, connects to, and pins gloo/NCCL to.

The master (node 0) binds only on the master address: the rendezvous store on --master-port
and the scheduler's plan socket on --master-port + 1. Every node's collectives use the interface
that carries its route to the master, never all interfaces.
"""
from __future__ import annotations

import fcntl
import socket
import struct

PLAN_PORT_OFFSET = 1
_SIOCGIFADDR = 0x8915


def resolve_ipv4(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError as exc:
        raise ValueError(f"--master-addr {host!r} does not resolve: {exc}") from None


def local_address_towards(ip: str, port: int) -> str:
    """This host's address on the route to ip:port (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((ip, port))
        return probe.getsockname()[0]


def interface_of(ip: str) -> str:
    """The network interface that holds address `ip` (what GLOO_SOCKET_IFNAME names)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR,
                                     struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue                        # no IPv4 address on it
            if socket.inet_ntoa(packed[20:24]) == ip:
                return name
    raise ValueError(f"no network interface holds {ip}")


def rendezvous_addr(master_ip: str, master_port: int) -> str:
    return f"tcp://{master_ip}:{master_port}"


def plan_addr(master_ip: str, master_port: int) -> str:
    return f"tcp://{master_ip}:{master_port + PLAN_PORT_OFFSET}"


def configure(cluster, parallel, ipc) -> str | None:
    """Fill in a multi-node group's tcp addresses (`ipc.dist_init_addr`, `ipc.plan_addr`) and
    return the network interface this node's collectives use; None on one host. Raises
    ValueError naming the problem (no secret, a master address that is not node 0's own, ranks
    that do not split over the nodes). `cluster`: config.ClusterArgs."""
    if cluster.nnodes == 1:
        return None
    from pagedserve import cluster_auth
    cluster.local_ranks(parallel.tensor_parallel_size)
    cluster_auth.read_secret(cluster.cluster_secret_file)      # refuse to start without it
    master_ip = resolve_ipv4(cluster.master_addr)
    ipc.dist_init_addr = rendezvous_addr(master_ip, cluster.master_port)
    ipc.plan_addr = plan_addr(master_ip, cluster.master_port)
    own_ip = master_ip if cluster.node_rank == 0 else local_address_towards(
        master_ip, cluster.master_port)
    try:
        return interface_of(own_ip)
    except ValueError:
        raise ValueError(f"--master-addr {cluster.master_addr} ({master_ip}) is not an address "
                         f"of this host, but node 0 binds it") from None
