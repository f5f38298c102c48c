"""kernels/native_lora.py (kernels/native/lora.c) against the torch reference
(kernels/lora_ref.py): segmented shrink and expand over rows of mixed slots, an output that is
a column slice of a wider tensor, rows without an adapter left alone, bad segments refused; in
every build variant this machine runs."""
from __future__ import annotations

import pytest
import torch
from lora_inputs import random_step, segments
from native_variants import PER_VARIANT

from pagedserve.kernels import lora_ref, native_lora

pytestmark = PER_VARIANT

# (rows, slots, K, rank, N): a decode batch of SmolLM2's q/k shapes, odd sizes with column tails
# and a rank short of a tile, one row, a wide expand (its MLP's gate), and a prefill large enough
# for the kernels to split over threads
SHAPES = [(64, 8, 576, 16, 192), (7, 3, 100, 7, 37), (1, 1, 64, 64, 64), (33, 4, 96, 8, 1536),
          (400, 4, 1536, 32, 1536)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_shrink_and_expand_match_the_reference(shape, threads):
    rows_n, slots_n, k, rank, n = shape
    x, a, b, row_slots = random_step(rows_n, slots_n, k, rank, n, seed=rows_n)
    rows, starts, slots = segments(row_slots)
    y = native_lora.shrink(x, a, rows, starts, slots, threads)
    y_ref = lora_ref.shrink_ref(x, a, rows, starts, slots)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    wide = torch.randn(rows_n, n + 9)
    expected = wide.clone()
    native_lora.expand(y_ref, b, rows, starts, slots, wide[:, 5:5 + n], threads)
    lora_ref.expand_ref(y_ref, b, rows, starts, slots, expected[:, 5:5 + n])
    torch.testing.assert_close(wide, expected, rtol=1e-5, atol=1e-4)
    untouched = row_slots < 0
    assert torch.equal(wide[untouched], expected[untouched])


def test_the_product_is_each_rows_own_adapter():
    """Every row of a slot gets its adapter's x A^T B^T, whatever its place in the batch."""
    x, a, b, _ = random_step(6, 3, 32, 4, 24, seed=1)
    row_slots = torch.tensor([2, -1, 0, 2, 1, 0])
    rows, starts, slots = segments(row_slots)
    out = torch.zeros(6, 24)
    native_lora.expand(native_lora.shrink(x, a, rows, starts, slots), b, rows, starts, slots, out)
    for row, slot in enumerate(row_slots.tolist()):
        want = torch.zeros(24) if slot < 0 else x[row] @ a[slot].t() @ b[slot]
        torch.testing.assert_close(out[row], want, rtol=1e-5, atol=1e-5)


def test_bad_segments_are_refused_with_the_cause():
    x, a, b, row_slots = random_step(4, 2, 16, 4, 8, seed=2)
    rows, starts, slots = segments(torch.tensor([0, 1, 1, 0]))
    with pytest.raises(ValueError, match="bad sizes or segments"):
        native_lora.shrink(x, a, rows, starts, torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="columns"):
        native_lora.shrink(x[:, :8], a, rows, starts, slots)
    with pytest.raises(ValueError, match="int64"):
        native_lora.shrink(x, a, rows.int(), starts, slots)
