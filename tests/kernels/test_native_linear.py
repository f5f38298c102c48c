"""kernels/native_linear.py (kernels/native/linear_f32.c) against a float64 product: every row
count of the 6-row micro-kernel and its remainders, partial panels, strided inputs, bad input."""
from __future__ import annotations

import pytest
import torch

from kernels import native_linear

pytestmark = pytest.mark.skipif(not native_linear.available(),
                                reason="the native kernels cannot be built here")


@pytest.mark.parametrize("n,k", [(1, 1), (15, 7), (16, 64), (17, 576), (100, 33), (49, 1536)])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_float64_for_every_row_count(rng, n, k, threads):
    weight = torch.randn(n, k, generator=rng)
    packed = native_linear.pack(weight)
    assert packed.shape == ((n + 15) // 16, k, 16)
    for m in range(1, 14):                    # 1..6 rows, then 6 + 1..6, then 12 + 1
        x = torch.randn(m, k, generator=rng)
        out = native_linear.linear(x, packed, n, threads)
        expected = (x.double() @ weight.double().t())
        assert out.shape == (m, n) and out.dtype == torch.float32
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5 * k ** 0.5)


def test_strided_rows_and_a_strided_weight(rng):
    wide = torch.randn(40, 100, generator=rng)
    weight = wide[:, 10:90]                    # rows 100 apart, 80 used
    x = torch.randn(9, 200, generator=rng)[:, 50:130]
    out = native_linear.linear(x, native_linear.pack(weight), 40)
    torch.testing.assert_close(out, x @ weight.t(), rtol=1e-5, atol=1e-4)
    cols = torch.randn(80, 9, generator=rng).t()     # column-major: copied, same result
    torch.testing.assert_close(native_linear.linear(cols, native_linear.pack(weight), 40),
                               cols @ weight.t(), rtol=1e-5, atol=1e-4)


def test_zero_rows_and_bad_input(rng):
    packed = native_linear.pack(torch.randn(20, 8, generator=rng))
    assert native_linear.linear(torch.empty(0, 8), packed, 20).shape == (0, 20)
    with pytest.raises(ValueError, match="does not fit"):
        native_linear.linear(torch.randn(2, 9), packed, 20)
    with pytest.raises(ValueError, match="does not fit"):
        native_linear.linear(torch.randn(2, 8), packed, 33)
    with pytest.raises(ValueError, match="fp32 CPU input"):
        native_linear.linear(torch.randn(2, 8).double(), packed, 20)
    with pytest.raises(ValueError, match="fp32 CPU weight"):
        native_linear.pack(torch.randn(4, 4).to(torch.bfloat16))
