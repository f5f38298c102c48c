"""kernels/native_topk.py (kernels/native/topk.c) against torch.topk and argmax, in every build
variant this machine runs: values and indices, equal values lower index first, NaN as -inf, rows
in rising order (every value enters the heap), strided rows, the limits on k."""
from __future__ import annotations

import pytest
import torch
from native_variants import PER_VARIANT

from pagedserve.kernels import native_topk

pytestmark = PER_VARIANT


@pytest.mark.parametrize("rows", [1, 64])
@pytest.mark.parametrize(("n", "k"), [(1, 1), (33, 1), (33, 33), (1000, 20), (151936, 1),
                                      (151936, 64), (151936, 1024)])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_torch_topk(rng, rows, n, k, threads):
    x = torch.randn(rows, n, generator=rng) * 3
    values, ids = native_topk.topk(x, k, threads)
    want_values, want_ids = torch.topk(x, k, dim=1)
    assert torch.equal(values, want_values) and torch.equal(x.gather(1, ids), values)
    # the same indices wherever a value occurs once (randn has rare ties; torch orders them
    # as it likes): unlike its neighbours in the top k, and the last one unlike the rest
    unique = torch.ones_like(values, dtype=torch.bool)
    unique[:, 1:] &= values[:, 1:] != values[:, :-1]
    unique[:, :-1] &= values[:, :-1] != values[:, 1:]
    unique[:, -1] &= (x == values[:, -1:]).sum(1) == 1
    assert torch.equal(ids[unique], want_ids[unique])


def test_equal_values_come_lower_index_first_and_k1_is_argmax():
    x = torch.zeros(2, 100)
    x[1, 40] = x[1, 7] = 1.0
    _, ids = native_topk.topk(x, 5)
    assert ids[0].tolist() == [0, 1, 2, 3, 4]
    assert ids[1].tolist() == [7, 40, 0, 1, 2]
    for row in (x, torch.randint(0, 3, (8, 999)).float()):
        values, first = native_topk.topk(row, 1)
        assert torch.equal(first.squeeze(1), row.argmax(dim=1))


def test_nan_ranks_as_minus_infinity_and_inf_rows_fill():
    x = torch.tensor([[1.0, float("nan"), 3.0, 3.0, float("-inf")]])
    values, ids = native_topk.topk(x, 4)
    assert ids.tolist() == [[2, 3, 0, 1]] and values[0, :3].tolist() == [3.0, 3.0, 1.0]
    x = torch.full((1, 50), float("-inf"))
    x[0, 33] = 0.0
    values, ids = native_topk.topk(x, 3)
    assert ids.tolist() == [[33, 0, 1]]


def test_rising_rows_and_strided_rows():
    rising = torch.arange(5000, dtype=torch.float32).repeat(2, 1)
    values, ids = native_topk.topk(rising, 64)
    assert ids[0].tolist() == list(range(4999, 4935, -1)) and torch.equal(ids[0], ids[1])
    wide = torch.randn(4, 3000)
    values, ids = native_topk.topk(wide[:, 500:2500], 16)
    want_values, _ = torch.topk(wide[:, 500:2500], 16, dim=1)
    assert torch.equal(values, want_values)


def test_limits_and_the_torch_fallback():
    x = torch.randn(2, 10)
    assert not native_topk.supports(x, 11) and not native_topk.supports(x, 0)
    assert not native_topk.supports(x.double(), 3) and not native_topk.supports(x.t(), 1)
    assert not native_topk.supports(torch.randn(1, 5000), 1025)
    with pytest.raises(ValueError, match="1 <= k"):
        native_topk.topk(x, 11)
    values, ids = native_topk.topk_or_torch(x.t(), 1)   # strided: torch's argmax
    assert torch.equal(ids.squeeze(1), x.t().argmax(dim=1))
    assert native_topk.topk(torch.empty(0, 10), 3)[0].shape == (0, 3)
