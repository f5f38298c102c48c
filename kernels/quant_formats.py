"""Quantized weight formats kept in memory as loaded: GGUF's block types and our int4-group type
(AWQ and GPTQ checkpoints, repacked at load), with the torch reference of their dequantization.

A `QuantizedWeight` is a linear's weight [n, k] as n rows of raw blocks along k: `data` is uint8
[n, k / block * block_bytes], each row exactly the bytes the format defines (for GGUF types, the
bytes of the file, read through mmap and never widened). Row operations (selecting the heads or
rows a tensor-parallel rank holds, llama.cpp's q/k row permutation) work on the bytes as they are;
a column slice (row-parallel ranks) must fall on block boundaries.

`I4G` (ours, id 1000) holds AWQ/GPTQ int4 groups, with group sizes 32, 64 or 128 split into blocks
of 32 that repeat their group's scale: per block of 32, fp32 d, fp32 m, then 16 bytes of nibbles
(element j in the low nibble of byte j, element j + 16 in the high nibble, as Q4_0/Q4_1), value
= d * q + m (m = -scale * zero, exact in fp32 for fp16 scales and zeros below 16). `perm`, when
set, is desc_act's order: the kernel multiplies x[:, perm] by the weight as stored.
"""
from __future__ import annotations

import dataclasses
from enum import IntEnum

import numpy as np
import torch


class QType(IntEnum):
    """Block types the native kernels (and the Triton ones) multiply without dequantizing;
    GGUF types keep ggml's ids."""
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    I4G = 1000


# type -> (elements per block, bytes per block)
BLOCKS: dict[QType, tuple[int, int]] = {
    QType.Q4_0: (32, 18), QType.Q4_1: (32, 20), QType.Q5_0: (32, 22), QType.Q8_0: (32, 34),
    QType.Q4_K: (256, 144), QType.Q5_K: (256, 176), QType.Q6_K: (256, 210),
    QType.I4G: (32, 24),
}


def block_size(qtype: int) -> int:
    return BLOCKS[QType(qtype)][0]


def row_bytes(qtype: int, k: int) -> int:
    elements, nbytes = BLOCKS[QType(qtype)]
    return k // elements * nbytes


@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A weight [n, k] kept in a block format (see the module docstring)."""
    qtype: QType
    data: torch.Tensor                  # uint8 [n, row_bytes(qtype, k)]
    k: int
    perm: torch.Tensor | None = None    # int64 [k]: multiply x[:, perm] (GPTQ desc_act)

    def __post_init__(self) -> None:
        elements = block_size(self.qtype)
        if self.k % elements:
            raise ValueError(f"{self.qtype.name}: {self.k} columns are not whole blocks of "
                             f"{elements}")
        if self.data.dtype != torch.uint8 or self.data.dim() != 2 \
                or self.data.shape[1] != row_bytes(self.qtype, self.k):
            raise ValueError(f"{self.qtype.name}: expected uint8 rows of "
                             f"{row_bytes(self.qtype, self.k)} bytes for {self.k} columns, got "
                             f"{self.data.dtype} {tuple(self.data.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.data.shape[0], self.k)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def numel(self) -> int:
        """The elements it stands for (n * k)."""
        return self.data.shape[0] * self.k

    def rows(self, index: torch.Tensor | slice) -> "QuantizedWeight":
        """Rows `index` (a slice: a view; an index tensor: a copy, unless it is every row in
        order)."""
        if isinstance(index, torch.Tensor) and index.numel() == self.data.shape[0] \
                and torch.equal(index, torch.arange(self.data.shape[0])):
            return self
        return dataclasses.replace(self, data=self.data[index])

    def cols(self, cols: slice) -> "QuantizedWeight":
        """Columns [start, stop) (block-aligned: ValueError otherwise)."""
        elements, nbytes = BLOCKS[self.qtype]
        start, stop = cols.start or 0, self.k if cols.stop is None else cols.stop
        if start % elements or stop % elements or self.perm is not None:
            raise ValueError(f"{self.qtype.name}: columns {start}:{stop} do not fall on blocks "
                             f"of {elements}")
        data = self.data[:, start // elements * nbytes:stop // elements * nbytes]
        return dataclasses.replace(self, data=data, k=stop - start)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [n, k] as `dtype` (columns back in checkpoint order when permuted)."""
        w = dequantize_ref(self.qtype, self.data, self.k).to(dtype)
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out


def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Rows of weights of one type, k and perm stacked: one weight."""
    first = parts[0]
    return dataclasses.replace(first, data=torch.cat([p.data for p in parts]))


def dequantize_ref(qtype: int, data: torch.Tensor, k: int) -> torch.Tensor:
    """fp32 [n, k] from rows of blocks: gguf-py's numpy dequantization for GGUF types (an
    implementation independent of ours), torch for I4G."""
    qtype = QType(qtype)
    rows = data.shape[0]
    if qtype == QType.I4G:
        blocks = data.reshape(rows, -1, 24)
        d = blocks[..., 0:4].contiguous().view(torch.float32)
        m = blocks[..., 4:8].contiguous().view(torch.float32)
        qs = blocks[..., 8:24].to(torch.int32)
        q = torch.cat([qs & 0xF, qs >> 4], dim=-1).to(torch.float32)
        return (q * d + m).reshape(rows, k)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    array = np.ascontiguousarray(data.numpy())
    return torch.from_numpy(dequantize(array, GGMLQuantizationType(int(qtype))).astype(
        np.float32)).reshape(rows, k)
