"""kernels/triton_lora.py against the torch reference (kernels/lora_ref.py): segmented shrink
and expand over rows of mixed slots in fp32, fp16 and bf16, an output that is a column slice,
rows without an adapter untouched; interpreter on CPU, compiled on a GPU (and compiled for
sm_90 by compile_for_gpu.py)."""
import pytest
import torch
from lora_inputs import random_step, segments
from triton_mode import DEVICE, run_in_interpreter

from pagedserve.kernels import lora_ref

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 6e-2}
# (rows, slots, K, rank, N): a segment longer than a row tile, ranks short of and past a tile
SHAPES = [(40, 3, 96, 8, 72), (5, 2, 64, 32, 16)]


def _module():
    from pagedserve.kernels import triton_lora
    return triton_lora


def kernels_run_here() -> bool:
    from triton.runtime.interpreter import InterpretedFunction
    return DEVICE == "cuda" or isinstance(_module()._sgmv_shrink_kernel, InterpretedFunction)


@pytest.fixture
def lora():
    if not kernels_run_here():
        pytest.skip("triton was imported without TRITON_INTERPRET=1: "
                    "test_triton_lora_in_subprocess runs these tests")
    return _module()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_shrink_and_expand_match_the_reference(lora, shape, dtype):
    rows_n, slots_n, k, rank, n = shape
    x, a, b, row_slots = random_step(rows_n, slots_n, k, rank, n, seed=rows_n)
    rows, starts, slots = segments(row_slots)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    y = lora.shrink(to(x).to(dtype), to(a).to(dtype), to(rows), to(starts), to(slots))
    y_ref = lora_ref.shrink_ref(x.double(), a.double(), rows, starts, slots)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(y.cpu().double(), y_ref, rtol=tol, atol=tol)
    wide = torch.randn(rows_n, n + 6)
    out = to(wide).to(dtype).clone()
    lora.expand(to(y_ref).to(dtype), to(b).to(dtype), to(rows), to(starts), to(slots),
                out[:, 3:3 + n])
    expected = wide.double()
    lora_ref.expand_ref(y_ref.to(dtype).double(), b.to(dtype).double(), rows, starts, slots,
                        expected[:, 3:3 + n])
    torch.testing.assert_close(out.cpu().double(), expected, rtol=tol, atol=tol * 4)
    untouched = (row_slots < 0).to(DEVICE)
    assert torch.equal(out[untouched], to(wide).to(dtype)[untouched])


def test_mismatched_inputs_are_refused(lora):
    x, a, b, row_slots = random_step(4, 2, 16, 4, 8, seed=2)
    rows, starts, slots = segments(row_slots)
    with pytest.raises(ValueError, match="columns"):
        lora.shrink(x[:, :8].to(DEVICE), a.to(DEVICE), rows.to(DEVICE), starts.to(DEVICE),
                    slots.to(DEVICE))
    with pytest.raises(ValueError, match="one float dtype"):
        lora.shrink(x.half().to(DEVICE), a.to(DEVICE), rows.to(DEVICE), starts.to(DEVICE),
                    slots.to(DEVICE))


@pytest.mark.skipif(kernels_run_here(), reason="the Triton tests above run in this process")
def test_triton_lora_in_subprocess():
    run_in_interpreter(__file__, "not in_subprocess")
