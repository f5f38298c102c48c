"""Linear layers on quantized weights kept as loaded (GGUF block types, AWQ/GPTQ int4 as I4G:
kernels/quant_formats.py) through kernels/native/linear_gguf.c: y = x W^T with x quantized per
call into int8 blocks (32 for the 32-element types, 256 for the k-quants) and integer dot
products against the weight's own integers.

`quantize_ref` and `linear_ref` are the torch reference the tests hold the kernel to: the
quantized x bit for bit, y to fp32 rounding of the block sums; `linear_ref` is also "the same
quantized arithmetic" whole-model tests compare greedy tokens with.
"""
from __future__ import annotations

import dataclasses

import torch

from . import native
from ._checks import require
from .quant_formats import BLOCKS, QType, QuantizedWeight, block_size, dequantize_ref, row_bytes

FEATURE = "linear_gguf"
_ZERO_BELOW = 2.0 ** -100   # a block with max|v| under this counts as zero (linear_gguf.c)
_STATUS = {-1: "bad sizes", -2: "out of memory", -3: "a type the kernel does not run"}


def available() -> bool:
    return native.library(FEATURE) is not None


def activation_block(qtype: int) -> int:
    """The block x is quantized in for weights of `qtype`: 32, or 256 for the k-quants."""
    return 256 if block_size(qtype) == 256 else 32


def quantize_ref(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [m, k] -> (q int8 [m, k], d fp32 [m, k / block], sums int16 [m, k / 16]) as the kernel
    quantizes activations: d = max|v| / 127 per block, q = round-half-even(v * (1 / d)), the sum
    of q per group of 16; blocks with max|v| < 2^-100 are zero, blocks holding inf/NaN get
    d = NaN and q = 0."""
    require(x.dim() == 2 and x.shape[1] % block == 0,
            f"quantize_ref: expected [m, k] with k a multiple of {block}, got {tuple(x.shape)}")
    m, k = x.shape
    blocks = x.float().reshape(m, k // block, block)
    amax = blocks.abs().amax(-1, keepdim=True)
    finite = torch.isfinite(blocks).all(-1, keepdim=True)
    live = finite & (amax >= _ZERO_BELOW)
    d = torch.where(live, amax / 127.0, torch.zeros_like(amax))
    inv = torch.where(live, 1.0 / torch.where(live, d, torch.ones_like(d)), torch.zeros_like(d))
    q = torch.where(live, torch.round(blocks * inv), torch.zeros_like(blocks)).to(torch.int8)
    d = torch.where(finite, d, torch.full_like(d, float("nan")))
    q = q.reshape(m, k)
    sums = q.view(m, k // 16, 16).sum(-1, dtype=torch.int32).to(torch.int16)
    return q, d.squeeze(-1), sums


def linear_ref(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """What `linear` computes, in float64: the dequantized weight times the quantized x."""
    if w.perm is not None:
        x = x[:, w.perm]
    block = activation_block(w.qtype)
    q, d, _ = quantize_ref(x, block)
    m, k = x.shape
    xd = (q.double().view(m, -1, block) * d.double().unsqueeze(-1)).view(m, k)
    # x is in the stored column order now: so is the weight
    return xd @ dequantize_ref(w.qtype, w.data, w.k).to(torch.float64).t()


def _library():
    lib = native.library(FEATURE)
    if lib is None:
        raise RuntimeError(f"native_linear_gguf: {native.unavailable_reason(FEATURE)}")
    return lib


def _check_rows(w: QuantizedWeight) -> None:
    if not (w.data.device.type == "cpu" and w.data.stride(1) == 1):
        raise ValueError(f"native_linear_gguf: the weight's rows must be contiguous CPU bytes, "
                         f"got {w.data.device} strides {w.data.stride()}")


# The types gguf_pack repacks into panels of 16 rows (kernels/native/gguf_packed.h) in every
# build with a packed body; Q6_K too where `packs` says so (builds with AVX2 + F16C)
PACKED_TYPES = frozenset({QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q8_0, QType.I4G, QType.Q4_K})


def packing_supported() -> bool:
    """Whether this build runs weights repacked into panels (its AVX-512 VNNI or AVX2 body)."""
    lib = native.library(FEATURE)
    return lib is not None and lib.gguf_packed_supported() == 1


def packs(qtype: QType) -> bool:
    """Whether this build packs (and runs packed) weights of `qtype`."""
    if not packing_supported():
        return False
    elements = block_size(qtype)
    return _library().gguf_packed_bytes(int(qtype), 16, elements) > 0


@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A QuantizedWeight of a type `packs` accepts repacked into panels of 16 rows: the raw bytes in
    the order the panel kernel reads them (Q4_K's 6-bit scales and mins as bytes), `pack` /
    `unpack`."""
    qtype: QType
    data: torch.Tensor                  # uint8 [gguf_packed_bytes(qtype, n, k)]
    n: int
    k: int
    perm: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def pack(w: QuantizedWeight) -> PackedWeight:
    """`w` repacked into panels (where `packs(w.qtype)`)."""
    _check_rows(w)
    n, k = w.shape
    lib = _library()
    out = torch.empty(max(lib.gguf_packed_bytes(int(w.qtype), n, k), 0), dtype=torch.uint8)
    status = lib.gguf_pack(int(w.qtype), w.data.data_ptr(), n, k, w.data.stride(0),
                           out.data_ptr())
    if status != 0:
        raise ValueError(f"native_linear_gguf.pack: {_STATUS.get(status, status)} for "
                         f"{w.qtype.name} [{n}, {k}]")
    return PackedWeight(w.qtype, out, n, k, w.perm)


def unpack(p: PackedWeight, rows: torch.Tensor | None = None) -> QuantizedWeight:
    """The raw weight `pack` was given, byte for byte; only `rows` (int64 indices) of it when
    given."""
    idx = None if rows is None else rows.reshape(-1).to(torch.int64).contiguous()
    count = p.n if idx is None else idx.numel()
    raw = torch.empty(count, row_bytes(p.qtype, p.k), dtype=torch.uint8)
    if count:
        status = _library().gguf_unpack_packed(int(p.qtype), p.data.data_ptr(), p.n, p.k,
                                               None if idx is None else idx.data_ptr(), count,
                                               raw.data_ptr(), raw.stride(0))
        if status != 0:
            raise ValueError(f"native_linear_gguf.unpack: {_STATUS.get(status, status)}"
                             + ("" if idx is None else f" (rows {int(idx.min())}.."
                                f"{int(idx.max())} of {p.n})"))
    return QuantizedWeight(p.qtype, raw, p.k, p.perm)


class BoundLinear:
    """`linear` for one weight, its arguments to the kernel worked out once (a model's layers
    hold one per weight: a decode step calls ~150 of them, and per-call argument work was most of
    a small call's cost). The weight must not be resized or moved while bound."""

    __slots__ = ("weight", "n", "k", "_args")

    def __init__(self, w: QuantizedWeight | PackedWeight) -> None:
        self.weight = w                      # keeps the bytes alive
        self.n, self.k = w.shape
        if isinstance(w, PackedWeight):
            self._args = (int(w.qtype), w.data.data_ptr(), self.n, self.k)
        else:
            _check_rows(w)
            self._args = (int(w.qtype), w.data.data_ptr(), self.n, self.k, w.data.stride(0))

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None,
                 threads: int | None = None) -> torch.Tensor:
        """x [m, k] fp32 @ W^T -> [m, n] fp32 (into `out` when given: see `linear`)."""
        # plain ifs: the messages are formatted only when a check fails
        if not (x.dtype == torch.float32 and x.dim() == 2 and x.device.type == "cpu"):
            raise ValueError(f"native_linear_gguf.linear: expected a 2-D fp32 CPU input, got "
                             f"{x.dtype} {tuple(x.shape)} on {x.device}")
        m, n = x.shape[0], self.n
        if x.shape[1] != self.k:
            raise ValueError(f"native_linear_gguf.linear: x has {x.shape[1]} features, the "
                             f"weight {self.k}")
        if self.weight.perm is not None:
            x = x[:, self.weight.perm]
        if x.stride(1) != 1:
            x = x.contiguous()
        if out is None:
            out = torch.empty(m, n, dtype=torch.float32)
        elif not (out.shape == (m, n) and out.dtype == torch.float32 and out.stride(1) == 1):
            raise ValueError(f"native_linear_gguf.linear: out must be fp32 [{m}, {n}] with unit "
                             f"column stride, got {out.dtype} {tuple(out.shape)} strides "
                             f"{out.stride()}")
        if m == 0:
            return out
        lib = _library()
        kernel = lib.gguf_linear if len(self._args) == 5 else lib.gguf_packed_linear
        status = kernel(*self._args, x.data_ptr(), m, x.stride(0), out.data_ptr(), out.stride(0),
                        threads or torch.get_num_threads())
        if status != 0:
            what = _STATUS.get(status, status)
            if status == -3 and len(self._args) == 4:
                what = "a packed weight, which this build does not run (packing_supported())"
            raise RuntimeError(f"native_linear_gguf.linear: {what} for "
                               f"{self.weight.qtype.name} m={m} k={self.k} n={n}")
        return out


def linear(x: torch.Tensor, w: QuantizedWeight | PackedWeight, out: torch.Tensor | None = None,
           threads: int | None = None) -> torch.Tensor:
    """x [m, k] fp32 @ W^T -> [m, n] fp32; `out` (a [m, n] fp32 view with unit column stride,
    e.g. columns of a wider output) receives it when given. The same bits for a weight and
    its `pack`ed form."""
    return BoundLinear(w)(x, out, threads)


def dequantize_rows(w: QuantizedWeight | PackedWeight, rows: torch.Tensor) -> torch.Tensor:
    """Rows `rows` (int64, any shape) of W as fp32 [*rows.shape, k] (embedding lookups)."""
    if isinstance(w, PackedWeight):
        picked = unpack(w, rows)
        return dequantize_rows(picked, torch.arange(picked.shape[0])).view(*rows.shape, w.k)
    _check_rows(w)
    n, k = w.shape
    idx = rows.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(idx.numel(), k, dtype=torch.float32)
    if idx.numel():
        status = _library().gguf_dequantize_rows(int(w.qtype), w.data.data_ptr(), n, k,
                                                 w.data.stride(0), idx.data_ptr(), idx.numel(),
                                                 out.data_ptr())
        if status != 0:
            raise ValueError(f"native_linear_gguf.dequantize_rows: {_STATUS.get(status, status)}"
                             f" (rows {int(idx.min())}..{int(idx.max())} of {n})")
    if w.perm is not None:
        plain = torch.empty_like(out)
        plain[:, w.perm] = out
        out = plain
    return out.view(*rows.shape, k)


def quantize_native(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's own activation quantization (for tests): as `quantize_ref`."""
    require(x.dtype == torch.float32 and x.dim() == 2 and x.shape[0] > 0 and x.stride(1) == 1,
            f"quantize_native: bad input {x.dtype} {tuple(x.shape)}")
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8)
    d = torch.empty(m, k // block, dtype=torch.float32)
    sums = torch.empty(m, k // 16, dtype=torch.int16)
    status = _library().gguf_quantize_rows(x.data_ptr(), m, k, x.stride(0), block, q.data_ptr(),
                                           d.data_ptr(), sums.data_ptr())
    require(status == 0, f"quantize_native: status {status}")
    return q, d, sums


def supports(qtype: int) -> bool:
    return qtype in set(QType)


# ---- a torch implementation of the kernel's own arithmetic, bit for bit -----------------------

def unpack_ref(w: QuantizedWeight) -> tuple[torch.Tensor, ...]:
    """The weight in gguf_unpack.h's one form: (u int64 [n, blocks, B], sc and mc int64 [n,
    blocks, B/16], d and dm fp32 [n, blocks]), w = d * sc * u - dm * mc per group of 16; Q4_0's
    and Q5_0's u are their signed u - z with dm = 0, as the kernels fold z into the integer sum."""
    qtype, n = QType(w.qtype), w.shape[0]
    elements, nbytes = BLOCKS[qtype]
    raw = w.data.reshape(n, -1, nbytes).to(torch.int64)
    blocks = raw.shape[1]

    def half(at: int) -> torch.Tensor:
        return w.data.reshape(n, blocks, nbytes)[..., at:at + 2].contiguous().view(
            torch.float16).squeeze(-1).float()

    def nibbles(qs: torch.Tensor) -> torch.Tensor:
        return torch.cat([qs & 15, qs >> 4], dim=-1)

    ones = torch.ones(n, blocks, elements // 16, dtype=torch.int64)
    if qtype in (QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q8_0, QType.I4G):
        if qtype == QType.I4G:
            fields = w.data.reshape(n, blocks, nbytes)[..., :8].contiguous().view(torch.float32)
            d, dm, u = fields[..., 0], -fields[..., 1], nibbles(raw[..., 8:])
        elif qtype == QType.Q8_0:
            d, u = half(0), raw[..., 2:].to(torch.uint8).view(torch.int8).to(torch.int64)
            dm = torch.zeros_like(d)
        elif qtype == QType.Q5_0:
            d = half(0)
            qh = sum(raw[..., 2 + i] << (8 * i) for i in range(4))
            bits = (qh.unsqueeze(-1) >> torch.arange(32)) & 1
            u, dm = (nibbles(raw[..., 6:]) | (bits << 4)) - 16, torch.zeros_like(d)
        elif qtype == QType.Q4_1:
            d, dm, u = half(0), -half(2), nibbles(raw[..., 4:])
        else:
            d, u = half(0), nibbles(raw[..., 2:]) - 8
            dm = torch.zeros_like(d)
        return u, ones, ones, d, dm
    if qtype == QType.Q6_K:
        ql, qh = raw[..., :128], raw[..., 128:192]
        scales = raw[..., 192:208].to(torch.uint8).view(torch.int8).to(torch.int64)
        d = half(208)
        parts = []
        for h in range(2):
            lo, hi = ql[..., 64 * h:64 * h + 64], qh[..., 32 * h:32 * h + 32]
            parts += [(lo[..., :32] & 15) | ((hi & 3) << 4), (lo[..., 32:] & 15) | (((hi >> 2) & 3) << 4),
                      (lo[..., :32] >> 4) | (((hi >> 4) & 3) << 4), (lo[..., 32:] >> 4) | (((hi >> 6) & 3) << 4)]
        return torch.cat(parts, dim=-1), scales, scales, d, 32 * d
    d, dmin, s = half(0), half(2), raw[..., 4:16]
    j = torch.arange(8)
    low = j < 4
    # ggml's get_scale_min_k4: 6-bit scales and mins, the high two bits of 4..7 in bytes 0..7
    sc = torch.where(low, s[..., j] & 63,
                     (s[..., (j + 4).clamp(max=11)] & 15) | ((s[..., (j - 4).clamp(min=0)] >> 6) << 4))
    mn = torch.where(low, s[..., (j + 4).clamp(max=11)] & 63,
                     (s[..., (j + 4).clamp(max=11)] >> 4) | ((s[..., j] >> 6) << 4))
    qs = raw[..., 16:144] if qtype == QType.Q4_K else raw[..., 48:176]
    parts = []
    for i in range(4):
        lo, hi = qs[..., 32 * i:32 * i + 32] & 15, qs[..., 32 * i:32 * i + 32] >> 4
        if qtype == QType.Q5_K:
            qh = raw[..., 16:48]
            lo, hi = lo | (((qh >> (2 * i)) & 1) << 4), hi | (((qh >> (2 * i + 1)) & 1) << 4)
        parts += [lo, hi]
    return (torch.cat(parts, dim=-1), sc.repeat_interleave(2, -1), mn.repeat_interleave(2, -1),
            d, dmin)


def linear_exact_ref(x: torch.Tensor, w: QuantizedWeight, unpacked: tuple | None = None,
                     chunk: int = 4096) -> torch.Tensor:
    """What `linear` computes, bit for bit, in torch: per block the exact integer sums (here in
    floats: every partial sum of 16 products is an integer below 2^24, its scaled sum below
    2^53), the fp32 term d da I1 - dm da I2, the terms summed in fp32 in block order.
    `unpacked`: unpack_ref(w), when the caller keeps it."""
    if w.perm is not None:
        x = x[:, w.perm]
    block = activation_block(w.qtype)
    q, da, sums = quantize_ref(x, block)
    m, k = x.shape
    blocks, groups = k // block, block // 16
    qb = q.float().view(m, blocks * groups, 16).transpose(0, 1)            # [bg, m, 16]
    sb = sums.double().view(m, blocks, groups)
    u, sc, mc, d, dm = unpacked if unpacked is not None else unpack_ref(w)
    out = []
    for start in range(0, w.shape[0], chunk):
        rows = slice(start, start + chunk)
        ug = u[rows].float().reshape(-1, blocks * groups, 16).permute(1, 2, 0)  # [bg, 16, n]
        partial = torch.bmm(qb, ug).view(blocks, groups, m, -1).permute(2, 3, 0, 1)
        i1 = (partial.double() * sc[rows].double().unsqueeze(0)).sum(-1).float()
        i2 = (sb.unsqueeze(1) * mc[rows].double().unsqueeze(0)).sum(-1).float()
        s1, s2 = d[rows].unsqueeze(0) * da.unsqueeze(1), dm[rows].unsqueeze(0) * da.unsqueeze(1)
        terms = s1 * i1 - s2 * i2
        acc = torch.zeros(m, terms.shape[1])
        for b in range(blocks):
            acc = acc + terms[..., b]
        out.append(acc)
    return torch.cat(out, dim=1)
