"""Tensor-parallel process group: gloo on CPU, NCCL on CUDA, and the two collectives we need."""
from __future__ import annotations

import datetime
import logging
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TPGroup:
    """This rank's place in the tensor-parallel group; `all_reduce` is a no-op at size 1."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tp rank {self.rank} is outside a group of size {self.size}")

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks in place and return it."""
        if self.size > 1:
            dist.all_reduce(tensor)
        return tensor

    def broadcast_from_first(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's `tensor` on every rank, in place; a no-op at size 1."""
        if self.size > 1:
            dist.broadcast(tensor, src=0)
        return tensor


def backend_for(device: torch.device | str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_distributed(rank: int, world_size: int, init_method: str, device: torch.device | str,
                     timeout_s: float = 600.0) -> TPGroup:
    """Join the default process group (skipped at world size 1) and return this rank's TPGroup.

    `init_method` is a torch.distributed URL: ``file://`` on one host; ``tcp://ADDR:PORT``
    across hosts, where rank 0 serves the rendezvous store on ADDR only (`bound_tcp_store`).
    """
    group = TPGroup(rank, world_size)
    if world_size == 1:
        return group
    backend = backend_for(device)
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
    timeout = datetime.timedelta(seconds=timeout_s)
    if init_method.startswith("tcp://"):
        store = bound_tcp_store(init_method, rank, world_size, timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
        dist.barrier()          # every rank has joined before the store is sealed
        if rank == 0:
            store.set(SEALED_KEY, "1")
    else:
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=world_size, timeout=timeout)
    log.info("tp rank %d/%d joined the %s group at %s", rank, world_size, backend, init_method)
    return group


SEALED_KEY = "pagedserve/sealed"   # set by rank 0 once its group has formed


def bound_tcp_store(init_method: str, rank: int, world_size: int,
                    timeout: datetime.timedelta) -> dist.TCPStore:
    """The rendezvous store at ``tcp://ADDR:PORT``. torch's own listens on every interface;
    here rank 0 binds the listening socket to ADDR itself and hands it to the store.

    A rank restarted on another host may find the store of the group it left, still served by
    a rank 0 that has not yet noticed the loss; that store is sealed (SEALED_KEY, set once
    every rank joined), so the rank waits for the next rank 0's fresh store instead of joining
    a group that is gone."""
    host, _, port = init_method.removeprefix("tcp://").rpartition(":")
    if rank == 0:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted rank 0
        listener.bind((host, int(port)))
        listener.listen(64)
        return dist.TCPStore(host, int(port), world_size, True, timeout=timeout,
                             wait_for_workers=False,   # the group's own rendezvous waits
                             master_listen_fd=listener.detach())
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        store = dist.TCPStore(host, int(port), world_size, False, timeout=timeout)
        if not store.check([SEALED_KEY]):
            return store
        if time.monotonic() > deadline:
            raise TimeoutError(f"the rendezvous at {init_method} stayed sealed for "
                               f"{timeout.total_seconds():.0f}s: node 0's group never restarted")
        log.info("the rendezvous at %s belongs to a group already formed; waiting for a new one",
                 init_method)
        del store
        time.sleep(1.0)


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
