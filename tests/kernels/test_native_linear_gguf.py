"""kernels/native/linear_gguf.c: every block type against the float64 product of its dequantized
weights with the quantized activations; the activation quantization bit for bit against its torch
reference; 1 and 2 threads, and every build variant this machine runs (portable C, AVX2, AVX-512,
native with VNNI), giving the same bits; rows dequantized like gguf-py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve.kernels import native, native_linear_gguf as gl
from pagedserve.kernels.quant_formats import BLOCKS, QType, QuantizedWeight, dequantize_ref

import native_variants

pytestmark = native_variants.NEEDS_COMPILER

TYPES = list(QType)
# where each type keeps its fp16 (or fp32 for I4G) block scales, and which are mins
SCALES = {QType.Q4_0: [0], QType.Q4_1: [0, 2], QType.Q5_0: [0], QType.Q8_0: [0],
          QType.Q4_K: [0, 2], QType.Q5_K: [0, 2], QType.Q6_K: [208]}
EXTREME_HALVES = [65504.0, 6e-8, 0.0, -0.0, 1e-4, 3.0]


def random_weight(qtype: QType, n: int, k: int, gen: torch.Generator,
                  extreme: bool = True) -> QuantizedWeight:
    """n rows of random blocks: random bytes everywhere, then sane scales (normal, times 1e-3),
    a share of them extreme (fp16's largest and smallest, zero) when `extreme`."""
    elements, nbytes = BLOCKS[qtype]
    raw = torch.randint(0, 256, (n, k // elements, nbytes), dtype=torch.uint8, generator=gen)
    shape = (n, k // elements)
    if qtype == QType.I4G:
        d = torch.randn(shape, generator=gen) * 1e-2
        m = torch.randn(shape, generator=gen) * 1e-2
        raw[..., 0:4] = d.view(torch.uint8).view(*shape, 4)
        raw[..., 4:8] = m.view(torch.uint8).view(*shape, 4)
        return QuantizedWeight(qtype, raw.view(n, -1).contiguous(), k)
    for offset in SCALES[qtype]:
        h = torch.randn(shape, generator=gen) * 1e-3
        if extreme:
            pick = torch.rand(shape, generator=gen) < 0.15
            h[pick] = torch.tensor(EXTREME_HALVES)[torch.randint(
                0, len(EXTREME_HALVES), (int(pick.sum()),), generator=gen)]
        raw[..., offset:offset + 2] = h.half().view(torch.uint8).view(*shape, 2)
    return QuantizedWeight(qtype, raw.view(n, -1).contiguous(), k)


def activations(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Normal rows with a zero block, a tiny block and a large one, when there is room."""
    x = torch.randn(m, k, generator=gen)
    if k >= 1024:
        x[:, 256:288] = 0.0
        x[:, 512:544] *= 1e-30
        x[:, 768:800] *= 1e4
    return x


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_each_type_equals_the_float64_product_of_what_it_stands_for(qtype, rng):
    for n, k, m in ((37, 1024, 1), (5, 512, 3), (64, 256, 17)):
        w = random_weight(qtype, n, k, rng)
        x = activations(m, k, rng)
        got = gl.linear(x, w).double()
        want = gl.linear_ref(x, w)
        # each block's sum is exact in int32; its fp32 term and the fp32 sum of the terms round
        assert torch.all((got - want).abs() <= 1e-5 * _bound(x, w)), (qtype.name, n, k, m)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_each_type_is_the_torch_implementation_of_its_arithmetic_bit_for_bit(qtype, rng):
    # k: 17 blocks of 32 (the wide panels' 16-quad transposes leave a tail) or 3 of 256
    k = 768 if gl.activation_block(qtype) == 256 else 544
    w = random_weight(qtype, 21, k, rng, extreme=False)
    for m in (1, 2, 4, 5, 7, 13):   # decode rows take the in-register path for most types
        # (up to 3, Q6_K up to 5), more rows the wide panels
        x = activations(m, k, rng)
        assert torch.equal(gl.linear(x, w), gl.linear_exact_ref(x, w)), m


def _bound(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """|x_quantized| @ |W|^T: what the rounding of the kernel's fp32 sums is relative to."""
    block = gl.activation_block(w.qtype)
    q, d, _ = gl.quantize_ref(x, block)
    xd = (q.double().view(x.shape[0], -1, block) * d.double().unsqueeze(-1)).view(x.shape)
    return xd.abs() @ dequantize_ref(w.qtype, w.data, w.k).double().abs().t() + 1e-30


def test_activation_quantization_is_the_torch_reference_bit_for_bit(rng):
    x = torch.randn(19, 1024, generator=rng) * 3
    x[0, :32] = 0.0                       # a zero block
    x[1, :256] *= 1e-35                   # below 2^-100: zero
    x[2, 40] = float("inf")               # a block holding inf: d = NaN, q = 0
    x[3, 300] = float("nan")
    x[4, :] = torch.arange(1024) - 511.5  # ties at .5 round to even
    for variant in native.VARIANTS:   # the AVX-512, AVX2 and scalar bodies alike
        if native.variant_unavailable_reason(variant) is not None:
            continue
        for block in (32, 256):
            with native.use_variant(variant):
                got = gl.quantize_native(x, block)
            want = gl.quantize_ref(x, block)
            assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2]), variant
            assert torch.equal(got[1].nan_to_num(-1.0), want[1].nan_to_num(-1.0)), variant


def test_one_and_two_threads_and_every_build_give_the_same_bits(rng):
    weights = [random_weight(t, 13, 512, rng) for t in TYPES]
    for m in (1, 5):
        _same_bits_everywhere(weights, activations(m, 512, rng))


def _same_bits_everywhere(weights: list[QuantizedWeight], x: torch.Tensor) -> None:
    portable = None
    for variant in native.VARIANTS:
        if native.variant_unavailable_reason(variant) is not None:
            continue
        with native.use_variant(variant):
            outs = [gl.linear(x, w, threads=1) for w in weights]
            for w, one in zip(weights, outs):
                assert torch.equal(one, gl.linear(x, w, threads=2)), (variant, w.qtype.name)
        if portable is None:
            with native.use_variant("portable"):
                portable = [gl.linear(x, w, threads=1) for w in weights]
        for w, got, want in zip(weights, outs, portable):
            assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)), (variant, w.qtype.name)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_rows_dequantize_like_gguf_py(qtype, rng):
    w = random_weight(qtype, 11, 512, rng)
    rows = torch.tensor([[10, 0], [3, 3]])
    got = gl.dequantize_rows(w, rows)
    want = dequantize_ref(qtype, w.data, w.k)[rows]
    assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))


def test_a_permuted_weight_multiplies_x_in_its_order(rng):
    w = random_weight(QType.I4G, 9, 256, rng)
    perm = torch.randperm(256, generator=rng)
    permuted = QuantizedWeight(w.qtype, w.data, w.k, perm)
    x = torch.randn(3, 256, generator=rng)
    assert torch.equal(gl.linear(x, permuted), gl.linear(x[:, perm].contiguous(), w))
    plain = permuted.dequantize()
    assert torch.allclose(gl.linear(x, permuted).double(), x.double() @ plain.double().t(),
                          rtol=0.05, atol=0.05)


def test_the_output_can_be_columns_of_a_wider_tensor(rng):
    a, b = random_weight(QType.Q4_K, 8, 512, rng), random_weight(QType.Q8_0, 5, 512, rng)
    x = torch.randn(4, 512, generator=rng)
    out = torch.full((4, 20), 9.0)
    gl.linear(x, a, out=out[:, 2:10])
    gl.linear(x, b, out=out[:, 12:17])
    assert torch.equal(out[:, 2:10], gl.linear(x, a)) and torch.equal(out[:, 12:17], gl.linear(x, b))
    assert (out[:, :2] == 9).all() and (out[:, 10:12] == 9).all() and (out[:, 17:] == 9).all()


def test_bad_inputs_are_refused(rng):
    w = random_weight(QType.Q4_0, 4, 64, rng)
    with pytest.raises(ValueError, match="features"):
        gl.linear(torch.randn(2, 32), w)
    with pytest.raises(ValueError, match="fp32"):
        gl.linear(torch.randn(2, 64, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="rows 0..4 of 4"):
        gl.dequantize_rows(w, torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="not whole blocks"):
        QuantizedWeight(QType.Q4_K, torch.zeros(2, 144, dtype=torch.uint8), 200)
    with pytest.raises(ValueError, match="rows of 144 bytes"):
        QuantizedWeight(QType.Q4_K, torch.zeros(2, 140, dtype=torch.uint8), 256)


def test_gguf_py_quantized_weights_multiply_like_their_dequantization():
    """Weights as llama.cpp's quantizers write them (gguf-py's, for the 32-element types): the
    product is close to x @ W_dequantized^T, within the activations' int8 rounding."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize
    gen = torch.Generator().manual_seed(3)
    wf = torch.randn(40, 512, generator=gen) * 0.05
    x = torch.randn(6, 512, generator=gen)
    for qtype in (QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q8_0):
        data = quantize(wf.numpy(), GGMLQuantizationType(int(qtype)))
        w = QuantizedWeight(qtype, torch.from_numpy(np.ascontiguousarray(data)), 512)
        exact = x.double() @ w.dequantize(torch.float64).t()
        rel = (gl.linear(x, w).double() - exact).norm() / exact.norm()
        assert rel < 0.01, (qtype.name, float(rel))


PACKED = sorted(gl.PACKED_TYPES | {QType.Q6_K})   # Q6_K where a variant packs it (AVX2, AVX-512)
needs_packing = pytest.mark.skipif(not gl.packing_supported(),
                                   reason="this build has no packed-panel body (AVX-512 VNNI "
                                          "or AVX2 + F16C)")


def _packing_variants(qtype: QType) -> list[str]:
    """The build variants this machine runs that pack `qtype` (AVX-512 and AVX2 bodies)."""
    found = []
    for variant in native.VARIANTS:
        if native.variant_unavailable_reason(variant) is None:
            with native.use_variant(variant):
                if gl.packs(qtype):
                    found.append(variant)
    return found


@needs_packing
@pytest.mark.parametrize("qtype", PACKED, ids=lambda t: t.name)
def test_packed_weights_unpack_to_their_bytes_and_multiply_to_the_same_bits(qtype, rng):
    """Packing keeps the bytes; every variant with a packed body (AVX-512's and AVX2's) gives
    the raw row paths' bits for each row count (1 to 4 rows a pass in registers, from 8 rows
    AVX2's panels spread once per call)."""
    variants = _packing_variants(qtype)
    if not variants:
        pytest.skip(f"no build variant here packs {qtype.name}")
    k = 768 if gl.activation_block(qtype) == 256 else 544     # 544: a 16-quad tail
    w = random_weight(qtype, 37, k, rng)            # a short last panel
    with native.use_variant(variants[0]):
        packed = gl.pack(w)
    # the raw bytes rearranged (3 panels of 16 rows); Q4_K keeps its 16 6-bit scales and mins
    # as bytes in place of their raw 12-byte field
    extra = 4 * (k // 256) if qtype == QType.Q4_K else 0
    assert packed.nbytes == 48 * (w.data.shape[1] + extra)
    ids = torch.tensor([[0, 36, 17], [16, 15, 3]])
    with native.use_variant(variants[0]):
        assert torch.equal(gl.unpack(packed).data, w.data)
        assert torch.equal(gl.unpack(packed, ids).data, w.data[ids.reshape(-1)])
        assert torch.equal(gl.dequantize_rows(packed, ids).nan_to_num(7.0),
                           gl.dequantize_rows(w, ids).nan_to_num(7.0))
    assert qtype == QType.Q6_K or native.variant() in variants   # the others: everywhere packed
    for m in (1, 2, 3, 4, 6, 7, 8, 13):
        x = activations(m, k, rng)
        raw = gl.linear(x, w, threads=1).nan_to_num(7.0)
        for variant in variants:
            with native.use_variant(variant):
                for threads in (1, 2):
                    got = gl.linear(x, packed, threads=threads).nan_to_num(7.0)
                    assert torch.equal(got, raw), (variant, m, threads)


@needs_packing
def test_a_packed_weight_on_a_build_without_the_body_is_refused_by_name(rng):
    packed = gl.pack(random_weight(QType.Q4_0, 16, 64, rng))
    with native.use_variant("portable"):
        with pytest.raises(RuntimeError, match="packed weight"):
            gl.linear(activations(1, 64, rng), packed)


def _largest_weight(qtype: QType, n: int, k: int, rng: torch.Generator) -> QuantizedWeight:
    """Every weight byte at its largest magnitude (u at its type's maximum; Q8_0's -127), the
    scales as random_weight makes them: the integer sums as large as the type allows."""
    w = random_weight(qtype, n, k, rng, extreme=False)
    elements, nbytes = BLOCKS[qtype]
    raw = w.data.view(n, k // elements, nbytes).clone()
    keep = torch.zeros(nbytes, dtype=torch.bool)
    for offset in ([0, 4] if qtype == QType.I4G else SCALES[qtype]):
        keep[offset:offset + (4 if qtype == QType.I4G else 2)] = True
    raw[..., ~keep] = 0x81 if qtype == QType.Q8_0 else 0xFF
    return QuantizedWeight(qtype, raw.view(n, -1).contiguous(), k)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_largest_integer_sums_are_exact_in_every_build(qtype, rng):
    """AVX2 adds several vpmaddubsw results in int16 lanes before it widens (sums16 in
    gguf_unpack.h): with every u at its maximum and every x at +-127, no lane may saturate or
    wrap. Raw rows and packed panels, the panel passes' row counts, against the portable C."""
    k = 512
    w = _largest_weight(qtype, 19, k, rng)
    for m in (1, 6, 13):                            # packed passes of 1-4 rows; wide panels
        x = torch.ones(m, k)
        x[1::2] = -1.0                              # x quantizes to +127 and -127 rows
        _same_bits_everywhere([w], x)
        with native.use_variant("portable"):
            want = gl.linear(x, w, threads=1).nan_to_num(7.0)
        for variant in _packing_variants(qtype) if gl.packing_supported() else []:
            with native.use_variant(variant):
                got = gl.linear(x, gl.pack(w), threads=1).nan_to_num(7.0)
            assert torch.equal(got, want), (variant, m)
