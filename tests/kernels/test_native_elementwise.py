"""kernels/native_elementwise.py (kernels/native/elementwise.c) against torch: RMSNorm with
and without the fused residual add, SiLU-and-mul over its whole input range, the bf16 versions,
bad input; in every build variant this machine runs (on x86 the portable one is SSE-only: the
8-lane vectors span two registers and the reassociation barrier goes through memory)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from native_variants import PER_VARIANT

from pagedserve.kernels import native_elementwise

pytestmark = PER_VARIANT

ROWS = (1, 7, 64, 300)
WIDTHS = (576, 64, 1536, 100)


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, weight.shape, weight, eps)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hidden", WIDTHS)
@pytest.mark.parametrize("threads", [1, 2])
def test_rms_norm_matches_torch(rng, rows, hidden, threads):
    x = torch.randn(rows, hidden, generator=rng) * 3
    weight = torch.randn(hidden, generator=rng)
    out = native_elementwise.rms_norm(x, weight, 1e-5, threads)
    assert out.shape == (rows, hidden) and out.dtype == torch.float32
    torch.testing.assert_close(out, _torch_rms_norm(x, weight, 1e-5), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hidden", WIDTHS)
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_add_rms_norm_updates_the_residual_in_place(rng, rows, hidden, threads):
    x = torch.randn(rows, hidden, generator=rng)
    residual = torch.randn(rows, hidden, generator=rng) * 10
    weight = torch.randn(hidden, generator=rng)
    expected_residual = residual + x
    storage = residual.data_ptr()
    out = native_elementwise.fused_add_rms_norm(x, residual, weight, 1e-6, threads)
    assert residual.data_ptr() == storage
    assert torch.equal(residual, expected_residual)          # one fp32 add: exact
    torch.testing.assert_close(out, _torch_rms_norm(expected_residual, weight, 1e-6),
                               rtol=2e-6, atol=1e-6)


def test_rms_norm_eps_dominates_tiny_rows():
    x = torch.full((2, 100), 1e-4)
    weight = torch.ones(100)
    torch.testing.assert_close(native_elementwise.rms_norm(x, weight, 1e-2),
                               _torch_rms_norm(x, weight, 1e-2), rtol=1e-6, atol=0)


def test_rms_norm_strided_rows(rng):
    wide = torch.randn(9, 700, generator=rng)
    x, residual = wide[:, 50:626], torch.randn(9, 1000, generator=rng)[:, :576]
    weight = torch.randn(576, generator=rng)
    expected_residual = residual + x
    out = native_elementwise.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(residual, expected_residual)
    torch.testing.assert_close(out, _torch_rms_norm(expected_residual, weight, 1e-5),
                               rtol=2e-6, atol=1e-6)


def _torch_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("inter", WIDTHS)
@pytest.mark.parametrize("threads", [1, 2])
def test_silu_mul_matches_torch(rng, rows, inter, threads):
    gate_up = torch.randn(rows, 2 * inter, generator=rng) * 4
    gate_up[:, :inter:7] *= 25                                 # gates out to about +-100
    out = native_elementwise.silu_mul(gate_up, threads)
    assert out.shape == (rows, inter) and out.dtype == torch.float32
    torch.testing.assert_close(out, _torch_silu_mul(gate_up), rtol=1e-6, atol=1e-30)


def test_silu_over_its_whole_range():
    """Every sign and magnitude, against float64: no inf or NaN, relative error under 1e-6 down
    to x = -87.3; below, where exp(x) leaves the normal floats, -0 (exact value under 1.1e-36)."""
    gate = torch.cat([torch.linspace(-120, 120, 400_001),
                      torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-45, 88.8, -88.8, 3e38, -3e38])])
    gate_up = torch.stack([gate, torch.ones_like(gate)], dim=1)
    out = native_elementwise.silu_mul(gate_up)[:, 0].double()
    exact = F.silu(gate.double())
    assert torch.isfinite(out).all()
    normal = (gate.double() >= -87.3) & (exact.abs() > 1e-37)
    error = (out - exact).abs()
    assert (error[normal] / exact.abs()[normal]).max() < 1e-6
    assert error[~normal].max() < 1.1e-36


def _assert_bf16_matches(out, expected):
    """Computed in fp32 and rounded once, like torch's bf16 ops: the same bf16 values but where
    a sum in another order lands on the other side of a rounding boundary (one ulp)."""
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), rtol=2.0 ** -7, atol=1e-6)
    assert float((out != expected).float().mean()) < 0.01        # measured: 0 to 0.1%


@pytest.mark.parametrize("rows,width", [(1, 576), (7, 100), (64, 576), (300, 1536)])
def test_bf16_rows_match_torch_bf16(rng, rows, width):
    x = torch.randn(rows, width, generator=rng).to(torch.bfloat16)
    residual = (torch.randn(rows, width, generator=rng) * 10).to(torch.bfloat16)
    weight = torch.randn(width, generator=rng).to(torch.bfloat16)
    _assert_bf16_matches(native_elementwise.rms_norm(x, weight, 1e-5),
                         _torch_rms_norm(x, weight, 1e-5))
    expected_residual = residual + x                 # torch's bf16 add: one rounding
    out = native_elementwise.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(residual, expected_residual)
    _assert_bf16_matches(out, _torch_rms_norm(expected_residual, weight, 1e-5))
    gate_up = (torch.randn(rows, 2 * width, generator=rng) * 4).to(torch.bfloat16)
    _assert_bf16_matches(native_elementwise.silu_mul(gate_up), _torch_silu_mul(gate_up))


def test_bf16_silu_keeps_torch_specials():
    gate = torch.tensor([float("nan"), float("inf"), -float("inf"), -100.0, -0.0, 1.0, 3e38])
    gate_up = torch.stack([gate, torch.full_like(gate, 2.0)], dim=1).to(torch.bfloat16)
    out, expected = native_elementwise.silu_mul(gate_up), _torch_silu_mul(gate_up)
    assert torch.equal(out.isnan(), expected.isnan())
    assert torch.equal(out[~out.isnan()], expected[~expected.isnan()])


def test_zero_rows_and_bad_input(rng):
    weight = torch.ones(8)
    assert native_elementwise.rms_norm(torch.empty(0, 8), weight, 1e-5).shape == (0, 8)
    assert native_elementwise.silu_mul(torch.empty(0, 8)).shape == (0, 4)
    x = torch.randn(3, 8, generator=rng)
    with pytest.raises(ValueError, match="x must be a 2-D fp32 or bf16 CPU tensor"):
        native_elementwise.rms_norm(x.double(), weight, 1e-5)
    with pytest.raises(ValueError, match="x must be a 2-D fp32 or bf16 CPU tensor"):
        native_elementwise.rms_norm(x.t(), weight, 1e-5)          # columns, not rows
    with pytest.raises(ValueError, match=r"weight must be .* of shape \(8,\)"):
        native_elementwise.rms_norm(x, torch.ones(9), 1e-5)
    with pytest.raises(ValueError, match=r"weight must be .* of shape \(8,\)"):
        native_elementwise.rms_norm(x, weight.to(torch.bfloat16), 1e-5)
    with pytest.raises(ValueError, match=r"residual shape \(4, 8\) != x shape \(3, 8\)"):
        native_elementwise.fused_add_rms_norm(x, torch.zeros(4, 8), weight, 1e-5)
    with pytest.raises(ValueError, match="residual must be .* of dtype torch.float32, got "
                                         "torch.bfloat16"):
        native_elementwise.fused_add_rms_norm(x, torch.zeros(3, 8, dtype=torch.bfloat16),
                                              weight, 1e-5)
    with pytest.raises(ValueError, match="gate_up must be a 2-D fp32 or bf16 CPU tensor"):
        native_elementwise.silu_mul(x.to(torch.float16))
    with pytest.raises(ValueError, match="even, nonzero number of columns, got 7"):
        native_elementwise.silu_mul(torch.randn(3, 7, generator=rng))


def test_supports():
    assert native_elementwise.supports(torch.zeros(2, 4), torch.zeros(1, 4))
    assert native_elementwise.supports(torch.zeros(2, 4, dtype=torch.bfloat16))
    assert not native_elementwise.supports(torch.zeros(2, 4), torch.zeros(2, 4).double())
    assert not native_elementwise.supports(torch.zeros(2, 4), torch.zeros(2, 4).bfloat16())
    assert not native_elementwise.supports(torch.zeros(2, 4, dtype=torch.float16))
    assert not native_elementwise.supports(torch.zeros(4))
    assert not native_elementwise.supports(torch.zeros(4, 2).t())

