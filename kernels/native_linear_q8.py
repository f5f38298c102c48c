"""int8 linear on CPU (`--quantization int8`) through kernels/native/linear_q8.c: y = x W^T, with
x and W both quantized in blocks of 32 along K (llama.cpp's Q8_0 scheme; see that file).

`pack(weight)` quantizes W once at load and lays it out in panels; `linear(x, packed)` quantizes
x's rows and multiplies. `quantize_ref` and `linear_ref` are the torch reference the tests hold
the kernel to: the quantized x bit for bit, y to fp32 rounding of the block scaling.

Accuracy on SmolLM2-135M, 24 ShareGPT first turns (prompt + reply, up to 512 tokens), every
linear and the LM head quantized (fake-quantized in torch, which computes the same values),
perplexity (fp32: 10.570) and how often the argmax agreed with fp32's:
- this scheme, x in blocks of 32 on 127 levels, W in blocks of 32 on 63 levels: 10.669, 94.3%;
- W on 127 levels too: 10.624, 96.2%, but vpmaddubsw then needs x's sign moved onto W
  (vpabsb/vpsignb per product), which cost more than the 63-level weights save;
- x on 63 levels, W on 127: 10.715, 93.6%;
- one scale per row of x (per token) instead of per block: 10.905-10.974, 88.7-90.1%.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from . import native
from ._checks import require

FEATURE = "linear_q8"
BLOCK = 32
PANEL = 16
_ZERO_BELOW = 2.0 ** -100   # a block with max|v| under this counts as zero (linear_q8.c)
WEIGHT_LEVELS = 63          # weights: q in [-63, 63], stored as q + 64 (see linear_q8.c)
WEIGHT_OFFSET = 64


class PackedQ8(NamedTuple):
    """A weight [n, k] quantized and packed by `pack`."""
    qweight: torch.Tensor   # uint8 [ceil(n/16), k/4, 16, 4] (q + 64): per 4 k, the 16 columns
    scales: torch.Tensor    # fp32 [ceil(n/16), k/32, 16]: one scale per column and block
    n: int
    k: int


def available() -> bool:
    return native.library(FEATURE) is not None


def supports(k: int) -> bool:
    """Whether a linear with `k` input features can be quantized (whole blocks of 32)."""
    return k >= BLOCK and k % BLOCK == 0


def quantize_ref(x: torch.Tensor, levels: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, k] (k a multiple of 32) -> (q int8 [m, k], d fp32 [m, k/32]) as linear_q8.c does
    for activations (levels 127; weights use 63): d = max|v| / levels per block,
    q = round-half-even(v * (1 / d)); blocks with max|v| < 2^-100 are zero; blocks holding
    inf/NaN get d = NaN and q = 0."""
    require(x.dim() == 2 and supports(x.shape[1]),
            f"quantize_ref: expected [m, k] with k a multiple of {BLOCK}, got {tuple(x.shape)}")
    blocks = x.float().reshape(x.shape[0], -1, BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    finite = torch.isfinite(blocks).all(-1, keepdim=True)
    live = finite & (amax >= _ZERO_BELOW)
    d = torch.where(live, amax / float(levels), torch.zeros_like(amax))
    inv = torch.where(live, 1.0 / torch.where(live, d, torch.ones_like(d)), torch.zeros_like(d))
    q = torch.where(live, torch.round(blocks * inv), torch.zeros_like(blocks)).to(torch.int8)
    d = torch.where(finite, d, torch.full_like(d, float("nan")))
    return q.reshape(x.shape), d.squeeze(-1)


def pack(weight: torch.Tensor) -> PackedQ8:
    """Quantize a CPU weight [n, k] (k a multiple of 32) into the kernel's panels."""
    require(weight.dim() == 2 and weight.device.type == "cpu" and weight.is_floating_point(),
            f"native_linear_q8.pack: expected a 2-D floating CPU weight, got {weight.dtype} "
            f"{tuple(weight.shape)} on {weight.device}")
    n, k = weight.shape
    require(supports(k), f"native_linear_q8.pack: in_features {k} is not a multiple of {BLOCK}")
    require(bool(torch.isfinite(weight).all()), "native_linear_q8.pack: the weight holds inf or NaN")
    q, d = quantize_ref(weight.detach(), WEIGHT_LEVELS)
    q = (q.to(torch.int16) + WEIGHT_OFFSET).to(torch.uint8)
    panels = (n + PANEL - 1) // PANEL
    pad = panels * PANEL - n
    if pad:
        q = torch.cat([q, q.new_zeros(pad, k)])
        d = torch.cat([d, d.new_zeros(pad, k // BLOCK)])
    qweight = q.view(panels, PANEL, k // 4, 4).permute(0, 2, 1, 3).contiguous()
    scales = d.view(panels, PANEL, k // BLOCK).permute(0, 2, 1).contiguous()
    return PackedQ8(qweight, scales, n, k)


def dequantize(packed: PackedQ8) -> torch.Tensor:
    """The fp32 weight [n, k] the packed one stands for (q * d)."""
    panels, k = packed.qweight.shape[0], packed.k
    q = packed.qweight.permute(0, 2, 1, 3).reshape(panels * PANEL, k)[:packed.n].to(torch.int16)
    q = q - WEIGHT_OFFSET
    d = packed.scales.permute(0, 2, 1).reshape(panels * PANEL, k // BLOCK)[:packed.n]
    return (q.float().view(packed.n, -1, BLOCK) * d.unsqueeze(-1)).view(packed.n, k)


def linear_ref(x: torch.Tensor, packed: PackedQ8) -> torch.Tensor:
    """What `linear` computes, in float64 then rounded: sum over blocks of d_x d_w (q_x . q_w)."""
    q, d = quantize_ref(x)
    blocks = packed.k // BLOCK
    xd = (q.double().view(-1, blocks, BLOCK) * d.double().unsqueeze(-1)).view(x.shape[0], -1)
    return (xd @ dequantize(packed).double().t()).float()


def linear(x: torch.Tensor, packed: PackedQ8, threads: int | None = None) -> torch.Tensor:
    """x [m, k] fp32 (rows contiguous) @ W^T -> [m, n] fp32, W packed by `pack`."""
    if not (x.dtype == torch.float32 and x.dim() == 2 and x.device.type == "cpu"):
        raise ValueError(f"native_linear_q8.linear: expected a 2-D fp32 CPU input, got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")
    m, k = x.shape
    if k != packed.k:
        raise ValueError(f"native_linear_q8.linear: x has {k} features, the weight {packed.k}")
    lib = native.library(FEATURE)
    if lib is None:
        raise RuntimeError(f"native_linear_q8.linear: {native.unavailable_reason(FEATURE)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(m, packed.n, dtype=torch.float32)
    if m == 0:
        return out
    status = lib.linear_q8(x.data_ptr(), m, k, x.stride(0), packed.qweight.data_ptr(),
                           packed.scales.data_ptr(), packed.n, out.data_ptr(), packed.n,
                           threads or torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"native_linear_q8.linear: status {status} for m={m} k={k} "
                           f"n={packed.n}" + (" (out of memory)" if status == -2 else ""))
    return out


def quantize_native(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's own activation quantization (for tests): x [m, k] fp32 -> (q, d)."""
    require(x.dtype == torch.float32 and x.dim() == 2 and supports(x.shape[1]) and x.shape[0] > 0
            and x.stride(1) == 1, f"quantize_native: bad input {x.dtype} {tuple(x.shape)}")
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8)
    d = torch.empty(m, k // BLOCK, dtype=torch.float32)
    status = native.library(FEATURE).quantize_rows_q8(x.data_ptr(), m, k, x.stride(0),
                                                      q.data_ptr(), d.data_ptr())
    require(status == 0, f"quantize_native: status {status}")
    return q, d
