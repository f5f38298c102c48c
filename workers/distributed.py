"""Tensor-parallel process group: gloo on CPU, NCCL on CUDA, and the one collective we need."""
from __future__ import annotations

import datetime
import logging
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


def backend_for(device: torch.device | str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_distributed(rank: int, world_size: int, init_method: str, device: torch.device | str,
                     timeout_s: float = 600.0) -> TPGroup:
    """Join the default process group (skipped at world size 1) and return this rank's TPGroup.

    `init_method` is a torch.distributed URL such as ``tcp://127.0.0.1:29500``.
    """
    group = TPGroup(rank, world_size)
    if world_size == 1:
        return group
    backend = backend_for(device)
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    log.info("tp rank %d/%d joined the %s group at %s", rank, world_size, backend, init_method)
    return group


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
