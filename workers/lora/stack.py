"""The LoRA weights of one linear, for every device slot, and their product with a step's rows.

A `LoRAStack` hangs on a PackableLinear (`linear.lora`) and adds, inside its matmul, each
adapter row's x A^T B^T (the scaling folded into B) to the projections it targets: for the
fused q/k/v and gate/up linears one part per projection, at that projection's columns. A slot
holds an adapter's A [R, K] and B [R, N] (rank-major), zero past its rank and for projections
it does not adapt; R is --max-lora-rank. Tensor parallel: a column-parallel linear keeps the
rows of B for this rank's outputs, a row-parallel one the columns of A for its inputs (the
partial products sum in the all-reduce that follows, as the base's do).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.kernels import lora_ref, native_lora
from pagedserve.workers.models.layers import (MergedColumnParallelLinear, PackableLinear,
                                              QKVParallelLinear, RowParallelLinear)


@dataclass(slots=True)
class LoRABatch:
    """A step's adapter rows grouped by slot: segment s is rows[seg_starts[s]:seg_starts[s+1]]
    (indices into the step's flat rows), which use slot seg_slots[s] (kernels/lora_ref.py)."""

    num_rows: int
    rows: torch.Tensor
    seg_starts: torch.Tensor
    seg_slots: torch.Tensor


class StepLoRA:
    """The batch every stack of a model reads in the current step (None: no adapter rows)."""

    __slots__ = ("batch",)

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None


@dataclass(slots=True)
class _Part:
    """One adapted projection inside a linear: its output columns, its rank rows in the
    linear's A (and so its columns of the shrink's result) and its B slots."""

    module: str
    out_offset: int
    rank_offset: int
    b: torch.Tensor   # [slots, R, N]


class LoRAStack:
    def __init__(self, linear: PackableLinear, modules: tuple[str, ...], num_slots: int,
                 max_rank: int, step: StepLoRA, device: torch.device) -> None:
        self.linear, self.step = linear, step
        self.num_slots, self.max_rank = num_slots, max_rank
        out, k = linear.weight.shape   # (a packed linear's plain weight may be meta by now)
        sizes = _part_sizes(linear, len(modules))
        if sum(sizes) != out:
            raise ValueError(f"LoRA parts {sizes} do not cover the linear's {out} outputs")
        dtype = linear.weight.dtype
        # The parts' A stacked: one shrink reads x once for q, k and v (or gate and up).
        self.a = torch.zeros(num_slots, len(modules) * max_rank, k, dtype=dtype, device=device)
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.parts = [_Part(m, off, i * max_rank,
                            torch.zeros(num_slots, max_rank, n, dtype=dtype, device=device))
                      for i, (m, off, n) in enumerate(zip(modules, offsets, sizes))]

    def write(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Slot `slot` takes an adapter's full (unsharded) A [r, in] and scaled B [out, r] per
        projection name; projections it leaves out are zero."""
        self.a[slot].zero_()
        for part in self.parts:
            part.b[slot].zero_()
            if part.module not in weights:
                continue
            a, b = _shard(self.linear, part.module, *weights[part.module])
            r = a.shape[0]
            self.a[slot, part.rank_offset:part.rank_offset + r].copy_(a)
            part.b[slot, :r].copy_(b.t())

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """out [T, N] += the adapter rows' products, in place (x [T, K] of the same step)."""
        batch = self.step.batch
        if batch is None or x.shape[0] != batch.num_rows:
            return
        shrink, expand = _kernels(x, out)
        segs = (batch.rows, batch.seg_starts, batch.seg_slots)
        y = shrink(x, self.a, *segs)
        rank = self.max_rank
        for part in self.parts:
            view = out[:, part.out_offset:part.out_offset + part.b.shape[2]]
            expand(y[:, part.rank_offset:part.rank_offset + rank], part.b, *segs, view)


def _kernels(x: torch.Tensor, out: torch.Tensor):
    """(shrink, expand): Triton's on CUDA, the native ones for fp32 on CPU, else torch's."""
    if x.device.type == "cuda":
        from pagedserve.kernels import triton_lora   # CPU processes never import Triton
        return triton_lora.shrink, triton_lora.expand
    if x.dtype == torch.float32 and native_lora.supports(x, out):
        return native_lora.shrink, native_lora.expand
    return lora_ref.shrink_ref, lora_ref.expand_ref


def _part_sizes(linear: PackableLinear, parts: int) -> list[int]:
    if isinstance(linear, QKVParallelLinear):
        return list(linear.sizes)
    if isinstance(linear, MergedColumnParallelLinear):
        return [linear.shard_size] * parts
    return [linear.weight.shape[0]]


def _shard(linear: PackableLinear, module: str, a: torch.Tensor, b: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of a projection's A and B (as the linear cuts its own weight)."""
    if isinstance(linear, QKVParallelLinear):
        shard = module[0]
        total, d = linear.total_heads[shard], linear.head_dim
        heads = b.view(total, d, b.shape[1])[linear.heads[shard]]
        if linear.head_perm is not None and shard != "v":
            heads = heads[:, linear.head_perm]
        return a, heads.reshape(-1, b.shape[1])
    if isinstance(linear, MergedColumnParallelLinear):
        return a, b[linear.rows]
    if isinstance(linear, RowParallelLinear):
        return a[:, linear.cols], b
    raise TypeError(f"no LoRA sharding for a {type(linear).__name__}")
