"""Linear layers and embeddings over weights kept in their quantized block formats
(kernels/quant_formats.py): the native kernels on CPU (kernels/native_linear_gguf.py, fp32
activations), the Triton ones on CUDA (kernels/triton_quant_linear.py).

A fused projection (q|k|v, gate|up) whose parts are stored in different types (a Q4_K_M file
keeps some v and down projections in Q6_K) runs one kernel call per run of parts of one type,
each writing its own columns of the output.
"""
from __future__ import annotations

import torch

from pagedserve import envs
from pagedserve.kernels.native_linear_gguf import PackedWeight
from pagedserve.kernels.quant_formats import QuantizedWeight, cat_rows


class QuantizedMatmul:
    """y = x W^T for W given as row segments [(first output column, QuantizedWeight)].

    On a CPU whose kernel build runs packed panels (kernels/native/gguf_packed.h), the segments
    of the 32-element types are repacked once, here, and the raw bytes let go (`stored`); the
    raw form stays readable as `segments` (unpacked back on first use: tests' references)."""

    def __init__(self, parts: list[tuple[int, QuantizedWeight]], device: torch.device) -> None:
        parts = sorted(parts, key=lambda part: part[0])
        segments: list[tuple[int, QuantizedWeight]] = []
        for offset, weight in parts:          # adjacent parts of one type: one call
            if segments:
                last_offset, last = segments[-1]
                if last.qtype == weight.qtype and last.k == weight.k and _same_perm(last, weight) \
                        and last_offset + last.shape[0] == offset:
                    segments[-1] = (last_offset, cat_rows([last, weight]))
                    continue
            segments.append((offset, weight))
        if device.type != "cpu":
            segments = [(o, _to_device(w, device)) for o, w in segments]
        self.stored: list[tuple[int, QuantizedWeight | PackedWeight]] = _packed(segments, device)
        packed = any(isinstance(w, PackedWeight) for _, w in self.stored)
        self._raw = None if packed else segments
        self._bound = None                    # the CPU kernel's calls, bound on first use
        self.out_features = sum(w.shape[0] for _, w in self.stored)
        self.in_features = self.stored[0][1].k
        self.device = device

    @property
    def segments(self) -> list[tuple[int, QuantizedWeight]]:
        """The weights in their raw block format (packed ones unpacked back, once)."""
        if self._raw is None:
            from pagedserve.kernels import native_linear_gguf
            self._raw = [(o, native_linear_gguf.unpack(w) if isinstance(w, PackedWeight) else w)
                         for o, w in self.stored]
        return self._raw

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for _, w in self.stored)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            from pagedserve.kernels import native_linear_gguf
            if self._bound is None:
                self._bound = [(offset, offset + weight.shape[0],
                                native_linear_gguf.BoundLinear(weight))
                               for offset, weight in self.stored]
            xf = x if x.dtype == torch.float32 else x.float()
            out = torch.empty(xf.shape[0], self.out_features, dtype=torch.float32)
            if len(self._bound) == 1:
                self._bound[0][2](xf, out)
            else:
                for start, stop, bound in self._bound:
                    bound(xf, out[:, start:stop])
            return out if x.dtype == torch.float32 else out.to(x.dtype)
        from pagedserve.kernels import triton_quant_linear
        outs = [triton_quant_linear.quant_linear(x, weight) for _, weight in self.stored]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def _packed(segments: list[tuple[int, QuantizedWeight]], device: torch.device
            ) -> list[tuple[int, QuantizedWeight | PackedWeight]]:
    """The segments of the packed types packed into panels where the CPU kernel runs them
    (kernels/native_linear_gguf.pack: the same bits, faster for every row count; not under
    PAGEDSERVE_PREPACK=0)."""
    if device.type != "cpu" or not envs.current().prepack:
        return segments
    from pagedserve.kernels import native_linear_gguf as gguf
    packed = {w.qtype for _, w in segments if gguf.packs(w.qtype)}
    return [(o, gguf.pack(w) if w.qtype in packed else w) for o, w in segments]


def _same_perm(a: QuantizedWeight, b: QuantizedWeight) -> bool:
    if a.perm is None or b.perm is None:
        return a.perm is None and b.perm is None
    return torch.equal(a.perm, b.perm)


def _to_device(w: QuantizedWeight, device: torch.device) -> QuantizedWeight:
    import dataclasses
    return dataclasses.replace(w, data=w.data.to(device),
                               perm=None if w.perm is None else w.perm.to(device))


def embed_rows(weight: QuantizedWeight | PackedWeight, ids: torch.Tensor, dtype: torch.dtype
               ) -> torch.Tensor:
    """Rows `ids` of a quantized embedding table, dequantized to `dtype`."""
    from pagedserve.kernels import native_linear_gguf
    rows = native_linear_gguf.dequantize_rows(weight, ids.cpu())
    return rows if rows.dtype == dtype else rows.to(dtype)
