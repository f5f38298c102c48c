"""kernels/native_linear.py (kernels/native/linear_panels.h: linear_f32.c, linear_bf16.c) against
a float64 product: every row count of the 6-row micro-kernel and its remainders, partial panels,
strided inputs, the bf16 layout and rounding, bad input; in every build variant this machine runs
(AVX-512 and AVX2 FMAs from the same vector extensions, and the portable build)."""
from __future__ import annotations

import pytest
import torch
from native_variants import PER_VARIANT

from pagedserve.kernels import native_linear

pytestmark = PER_VARIANT


def _assert_matches_float64(out, x, weight):
    """fp32: the float64 product to fp32 rounding; bf16: that product rounded to bf16 (half an
    ulp, 2^-9 of the value), give or take the fp32 sum's own error."""
    expected = x.double() @ weight.double().t()
    k = x.shape[1]
    rtol = 1e-5 if out.dtype == torch.float32 else 2.0 ** -8
    torch.testing.assert_close(out.double(), expected, rtol=rtol, atol=1e-5 * k ** 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n,k", [(1, 1), (15, 7), (16, 64), (17, 576), (100, 33), (49, 1536)])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_float64_for_every_row_count(rng, n, k, threads, dtype):
    weight = torch.randn(n, k, generator=rng).to(dtype)
    packed = native_linear.pack(weight)
    assert packed.shape == ((n + 15) // 16, k, 16) and packed.dtype == dtype
    assert torch.equal(native_linear.unpack(packed, n), weight)
    for m in range(1, 14):                    # 1..6 rows, then 6 + 1..6, then 12 + 1
        x = torch.randn(m, k, generator=rng).to(dtype)
        out = native_linear.linear(x, packed, n, threads)
        assert out.shape == (m, n) and out.dtype == dtype
        _assert_matches_float64(out, x, weight)


def test_bf16_rounds_the_fp32_sum_half_to_even_like_torch(rng):
    # Sums that are exact in fp32 (small integers times powers of two), so the only rounding
    # is the final one to bf16: it must be torch's, ties to even included.
    weight = torch.randint(-8, 9, (40, 24), generator=rng).to(torch.bfloat16)
    x = (torch.randint(-64, 65, (9, 24), generator=rng) * 2.0 ** -3).to(torch.bfloat16)
    exact = x.float() @ weight.float().t()           # exact: |sum| < 2^24 at this scale
    out = native_linear.linear(x, native_linear.pack(weight), 40)
    assert torch.equal(out, exact.to(torch.bfloat16))
    # exact fp32 sums halfway between two bf16 values: 257 -> 256, 259 -> 260 (to even)
    pairs = torch.tensor([[256.0, 1.0], [256.0, 3.0], [-256.0, -1.0], [1.0, 2.0 ** -8]])
    out = native_linear.linear(pairs.to(torch.bfloat16),
                               native_linear.pack(torch.ones(1, 2, dtype=torch.bfloat16)), 1)
    assert out[:, 0].tolist() == [256.0, 260.0, -256.0, 1.0]
    assert torch.equal(out, pairs.sum(1, keepdim=True).to(torch.bfloat16))
    nan = native_linear.linear(torch.full((1, 2), float("nan"), dtype=torch.bfloat16),
                               native_linear.pack(torch.ones(3, 2, dtype=torch.bfloat16)), 3)
    assert nan.isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_strided_rows_and_a_strided_weight(rng, dtype):
    wide = torch.randn(40, 100, generator=rng).to(dtype)
    weight = wide[:, 10:90]                    # rows 100 apart, 80 used
    x = torch.randn(9, 200, generator=rng).to(dtype)[:, 50:130]
    _assert_matches_float64(native_linear.linear(x, native_linear.pack(weight), 40), x, weight)
    cols = torch.randn(80, 9, generator=rng).to(dtype).t()     # column-major: copied
    _assert_matches_float64(native_linear.linear(cols, native_linear.pack(weight), 40), cols,
                            weight)


def test_zero_rows_and_bad_input(rng):
    packed = native_linear.pack(torch.randn(20, 8, generator=rng))
    assert native_linear.linear(torch.empty(0, 8), packed, 20).shape == (0, 20)
    with pytest.raises(ValueError, match="does not fit"):
        native_linear.linear(torch.randn(2, 9), packed, 20)
    with pytest.raises(ValueError, match="does not fit"):
        native_linear.linear(torch.randn(2, 8), packed, 33)
    with pytest.raises(ValueError, match="input of the weight's dtype"):
        native_linear.linear(torch.randn(2, 8).double(), packed, 20)
    with pytest.raises(ValueError, match="input of the weight's dtype"):
        native_linear.linear(torch.randn(2, 8).to(torch.bfloat16), packed, 20)
    with pytest.raises(ValueError, match="fp32 or bf16 CPU weight"):
        native_linear.pack(torch.randn(4, 4).to(torch.float16))
