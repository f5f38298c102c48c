"""KV cache allocation: the device pool and the host swap pool, sized from a byte budget.

Layout (docs/INTERFACES.md): `[num_layers, 2, num_blocks, block_size, num_kv_heads_on_rank,
head_dim]`, index 0 = K, 1 = V; the host pool has the same layout with its own block count.
"""
from __future__ import annotations

import mmap
import os

import torch

from pagedserve.private_files import PRIVATE_MODE, PrivateFileError, check_private

from pagedserve.workers.loader import ModelConfig
from pagedserve.workers.models.layers import partition_heads


def kv_heads_on_rank(config: ModelConfig, tp_size: int, tp_rank: int) -> int:
    return len(partition_heads(config.num_attention_heads, config.num_key_value_heads,
                               tp_size, tp_rank).kv_heads)


def block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> int:
    """Bytes one block takes on the most loaded rank (all layers, K and V)."""
    heads = max(kv_heads_on_rank(config, tp_size, r) for r in range(tp_size))
    itemsize = torch.empty((), dtype=dtype).element_size()
    return config.num_hidden_layers * 2 * block_size * heads * config.head_dim * itemsize


def num_blocks_for_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype,
                         budget_bytes: int, tp_size: int = 1) -> int:
    """How many whole blocks fit in `budget_bytes` on every rank."""
    if budget_bytes < 0:
        raise ValueError(f"KV cache budget must be >= 0 bytes, got {budget_bytes}")
    return budget_bytes // block_bytes(config, block_size, dtype, tp_size)


def device_budget_bytes(device: torch.device | str, *, kv_cache_memory: int | None = None,
                        memory_utilization: float = 0.9) -> int:
    """Bytes for the device pool: the explicit `--kv-cache-memory`, else on CUDA the given
    fraction of the memory free now (call after the weights are loaded)."""
    if kv_cache_memory is not None:
        return kv_cache_memory
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError("on a CPU worker the KV cache size must be given in bytes "
                         "(--kv-cache-memory); there is no device memory to take a fraction of")
    if not 0.0 < memory_utilization <= 1.0:
        raise ValueError(f"memory utilization must be in (0, 1], got {memory_utilization}")
    free, _total = torch.cuda.mem_get_info(device)
    return int(free * memory_utilization)


def kv_cache_shape(config: ModelConfig, num_blocks: int, block_size: int, tp_size: int = 1,
                   tp_rank: int = 0) -> tuple[int, ...]:
    return (config.num_hidden_layers, 2, num_blocks, block_size,
            kv_heads_on_rank(config, tp_size, tp_rank), config.head_dim)


def allocate_kv_cache(config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device | str, tp_size: int = 1, tp_rank: int = 0) -> torch.Tensor:
    """The device pool. Zero-filled so a stray read of an unwritten slot is finite, not NaN."""
    if num_blocks < 1:
        raise ValueError(f"the KV cache needs at least one block, got {num_blocks} "
                         "(raise --kv-cache-memory or lower --block-size)")
    shape = kv_cache_shape(config, num_blocks, block_size, tp_size, tp_rank)
    return torch.zeros(shape, dtype=dtype, device=device)


def allocate_swap_pool(kv_cache: torch.Tensor, num_cpu_blocks: int,
                       shm_name: str | None = None) -> torch.Tensor:
    """The host pool for swapped-out blocks: kv_cache's layout with `num_cpu_blocks` blocks,
    pinned when the device pool is on CUDA so swaps can be asynchronous copies.

    With `shm_name` the pool lives in POSIX shared memory under that name, created on first use
    and attached again by a restarted worker, so swapped-out sequences survive a worker crash.
    The segment is not tied to this process's lifetime: the launcher removes it at exit.
    """
    shape = list(kv_cache.shape)
    shape[2] = num_cpu_blocks
    if shm_name is None or num_cpu_blocks == 0:
        pin = kv_cache.is_cuda and num_cpu_blocks > 0
        return torch.zeros(shape, dtype=kv_cache.dtype, device="cpu", pin_memory=pin)
    nbytes = kv_cache.element_size()
    for dim in shape:
        nbytes *= dim
    if _shm_free_bytes() < nbytes:  # writing past a full tmpfs would kill us with SIGBUS
        import logging
        logging.getLogger(__name__).warning(
            "/dev/shm has less than the %d bytes of the swap pool free: it stays private, and "
            "swapped-out sequences are recomputed if this worker restarts", nbytes)
        return torch.zeros(shape, dtype=kv_cache.dtype, device="cpu")
    buf = _shared_buffer(shm_name, nbytes)
    return torch.frombuffer(buf, dtype=kv_cache.dtype, count=nbytes // kv_cache.element_size()
                            ).view(shape)


def _shm_free_bytes() -> int:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


_SEGMENTS: list = []  # keep mappings alive for the process's lifetime


def _shared_buffer(name: str, nbytes: int) -> memoryview:
    """The first start of a rank creates the segment (exclusively, mode 0600); a restarted
    worker attaches to the one its predecessor left, but only after checking it is ours and
    private: a segment another user planted under the name would let them read the cache.
    Not registered with Python's resource tracker, which would unlink it when this process
    exits (even by a crash): the pool must outlive a worker, so the launcher removes it."""
    import _posixshmem
    path = "/" + name
    created = True
    try:
        fd = _posixshmem.shm_open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, PRIVATE_MODE)
    except FileExistsError:
        created = False
        fd = _open_existing(name)
    try:
        if created:
            os.ftruncate(fd, nbytes)
        else:
            info = os.fstat(fd)
            check_private(info, f"shared swap pool /dev/shm/{name}")
            size = info.st_size
            if size < nbytes:
                raise ValueError(f"shared swap pool {name!r} has {size} bytes, need {nbytes}: "
                                 "a segment of another configuration is in the way")
        mapping = mmap.mmap(fd, nbytes)
    except BaseException:
        if created:
            _posixshmem.shm_unlink(path)
        raise
    finally:
        os.close(fd)
    _SEGMENTS.append(mapping)
    return memoryview(mapping)


def _open_existing(name: str) -> int:
    import _posixshmem
    try:
        return _posixshmem.shm_open("/" + name, os.O_RDWR, 0)
    except PermissionError:
        raise PrivateFileError(f"shared swap pool /dev/shm/{name} exists and this user cannot "
                               "open it: another user created it; refused") from None
