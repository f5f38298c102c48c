"""Linear layers and embeddings over weights kept in their quantized block formats
(kernels/quant_formats.py): the native kernels on CPU (kernels/native_linear_gguf.py, fp32
activations), the Triton ones on CUDA (kernels/triton_quant_linear.py).

A fused projection (q|k|v, gate|up) whose parts are stored in different types (a Q4_K_M file
keeps some v and down projections in Q6_K) runs one kernel call per run of parts of one type,
each writing its own columns of the output.
"""
from __future__ import annotations

import torch

from pagedserve.kernels.quant_formats import QuantizedWeight, cat_rows


class QuantizedMatmul:
    """y = x W^T for W given as row segments [(first output column, QuantizedWeight)]."""

    def __init__(self, parts: list[tuple[int, QuantizedWeight]], device: torch.device) -> None:
        parts = sorted(parts, key=lambda part: part[0])
        self.segments: list[tuple[int, QuantizedWeight]] = []
        for offset, weight in parts:          # adjacent parts of one type: one call
            if self.segments:
                last_offset, last = self.segments[-1]
                if last.qtype == weight.qtype and last.k == weight.k and _same_perm(last, weight) \
                        and last_offset + last.shape[0] == offset:
                    self.segments[-1] = (last_offset, cat_rows([last, weight]))
                    continue
            self.segments.append((offset, weight))
        if device.type != "cpu":
            self.segments = [(o, _to_device(w, device)) for o, w in self.segments]
        self.out_features = sum(w.shape[0] for _, w in self.segments)
        self.in_features = self.segments[0][1].k
        self.device = device

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for _, w in self.segments)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            from pagedserve.kernels import native_linear_gguf
            xf = x if x.dtype == torch.float32 else x.float()
            out = torch.empty(xf.shape[0], self.out_features, dtype=torch.float32)
            for offset, weight in self.segments:
                native_linear_gguf.linear(xf, weight, out=out[:, offset:offset + weight.shape[0]])
            return out if x.dtype == torch.float32 else out.to(x.dtype)
        from pagedserve.kernels import triton_quant_linear
        outs = [triton_quant_linear.quant_linear(x, weight) for _, weight in self.segments]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def _same_perm(a: QuantizedWeight, b: QuantizedWeight) -> bool:
    if a.perm is None or b.perm is None:
        return a.perm is None and b.perm is None
    return torch.equal(a.perm, b.perm)


def _to_device(w: QuantizedWeight, device: torch.device) -> QuantizedWeight:
    import dataclasses
    return dataclasses.replace(w, data=w.data.to(device),
                               perm=None if w.perm is None else w.perm.to(device))


def embed_rows(weight: QuantizedWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of a quantized embedding table, dequantized to `dtype`."""
    from pagedserve.kernels import native_linear_gguf
    rows = native_linear_gguf.dequantize_rows(weight, ids.cpu())
    return rows if rows.dtype == dtype else rows.to(dtype)
