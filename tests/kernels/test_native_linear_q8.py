"""kernels/native/linear_q8.c (--quantization int8) against its torch reference, in every build
variant this machine runs (the AVX2 vpmaddubsw sums and the portable plain-C ones)."""
import pytest
import torch
from native_variants import PER_VARIANT

from pagedserve.kernels import native_linear_q8 as q8

pytestmark = PER_VARIANT


def test_activation_quantization_matches_the_reference_bit_for_bit():
    rng = torch.Generator().manual_seed(0)
    x = torch.randn(37, 192, generator=rng) * torch.logspace(-3, 3, 192)  # outlier channels
    x[3, :32] = 0.0                                   # an all-zero block
    x[4, 32:64] = 1e-35                               # under 2^-100: counts as zero
    x[5, 64:96] = torch.arange(32) - 15.5             # halves: ties round to even
    x[6, 96:128] = torch.arange(32) * 127 / 31 - 63.5
    q, d = q8.quantize_native(x)
    q_ref, d_ref = q8.quantize_ref(x)
    assert torch.equal(q, q_ref) and torch.equal(d, d_ref)
    assert int(q.abs().max()) == 127 and not q[3, :32].any() and not q[4, 32:64].any()
    assert d[3, 0] == 0 and d[4, 1] == 0


def test_non_finite_blocks_give_nan_scales_and_zero_values():
    x = torch.ones(2, 64)
    x[0, 5] = float("inf")
    x[1, 40] = float("nan")
    q, d = q8.quantize_native(x)
    q_ref, d_ref = q8.quantize_ref(x)
    assert torch.equal(q, q_ref) and torch.equal(d.isnan(), d_ref.isnan())
    assert d[0, 0].isnan() and d[1, 1].isnan() and d[0, 1] == d[1, 0] == 1 / 127
    assert not q[0, :32].any() and not q[1, 32:].any()


@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (2, 17, 64), (4, 33, 96), (5, 100, 576),
                                   (13, 960, 576), (64, 576, 1536), (3, 1, 32)])
def test_linear_matches_the_reference(m, n, k):
    rng = torch.Generator().manual_seed(m * 1000 + n + k)
    w, x = torch.randn(n, k, generator=rng), torch.randn(m, k, generator=rng)
    packed = q8.pack(w)
    out = q8.linear(x, packed)
    ref = q8.linear_ref(x, packed)
    assert out.shape == (m, n)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max())), (m, n, k)
    # and what the quantization costs against fp32 (blocks of 32, weights on 63 levels)
    exact = x.double() @ w.double().t()
    assert float((out.double() - exact).norm() / exact.norm()) < 0.03


def test_threads_strided_rows_and_empty_input():
    rng = torch.Generator().manual_seed(1)
    w, x = torch.randn(70, 128, generator=rng), torch.randn(9, 256, generator=rng)[:, 64:192]
    packed = q8.pack(w)
    one = q8.linear(x, packed, threads=1)
    assert torch.equal(one, q8.linear(x, packed, threads=3))        # panels split, same sums
    assert torch.equal(one, q8.linear(x.contiguous(), packed, threads=2))
    assert q8.linear(x[:0], packed).shape == (0, 70)


def test_dequantized_weight_is_within_half_a_step_of_the_original():
    rng = torch.Generator().manual_seed(2)
    w = torch.randn(40, 96, generator=rng)
    packed = q8.pack(w)
    back = q8.dequantize(packed)
    step = w.view(40, 3, 32).abs().amax(-1, keepdim=True) / q8.WEIGHT_LEVELS
    assert bool(((back - w).view(40, 3, 32).abs() <= step / 2 + 1e-7).all())
    assert packed.qweight.dtype == torch.uint8 and int(packed.qweight.max()) <= 127


def test_bad_input_is_refused_with_the_cause():
    packed = q8.pack(torch.randn(8, 64))
    with pytest.raises(ValueError, match="not a multiple of 32"):
        q8.pack(torch.randn(8, 48))
    with pytest.raises(ValueError, match="inf or NaN"):
        q8.pack(torch.full((8, 64), float("nan")))
    with pytest.raises(ValueError, match="2-D fp32 CPU input"):
        q8.linear(torch.randn(2, 64, dtype=torch.float64), packed)
    with pytest.raises(ValueError, match="x has 32 features, the weight 64"):
        q8.linear(torch.randn(2, 32), packed)

