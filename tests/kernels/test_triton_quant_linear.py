"""kernels/triton_quant_linear.py against x.double() @ W.double().T, W dequantized by gguf-py
(GGUF types) or quant_formats.dequantize_ref (I4G): interpreter on CPU, compiled on a GPU.

Weights are gguf-py's quantization of random floats (the 32-element types: gguf-py cannot
quantize K types) and random raw bytes with sane scales (every type); both have zero scales."""
import dataclasses

import pytest
import torch
from paged_inputs import rel_error
from triton_mode import DEVICE, run_in_interpreter

from pagedserve.kernels import _checks
from pagedserve.kernels.quant_formats import BLOCKS, QType, QuantizedWeight

GGUF_QUANTIZE = (QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q8_0)
# byte offsets of each block's fp16 scales (I4G: fp32 d and m)
SCALES = {QType.Q4_0: (0,), QType.Q4_1: (0, 2), QType.Q5_0: (0,), QType.Q8_0: (0,),
          QType.Q4_K: (0, 2), QType.Q5_K: (0, 2), QType.Q6_K: (208,), QType.I4G: (0, 4)}
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 6e-3}


def _module():
    from pagedserve.kernels import triton_quant_linear
    return triton_quant_linear


def kernels_run_here() -> bool:
    from triton.runtime.interpreter import InterpretedFunction
    return DEVICE == "cuda" or isinstance(_module()._quant_linear_kernel, InterpretedFunction)


@pytest.fixture
def quant_linear(monkeypatch):
    """The kernel's wrapper, outputs starting as NaN (an element never written fails)."""
    if not kernels_run_here():
        pytest.skip("triton was imported without TRITON_INTERPRET=1: "
                    "test_quant_linear_in_subprocess runs these tests")
    monkeypatch.setattr(_checks, "new_output", lambda shape, like: torch.full(
        shape, float("nan"), dtype=like.dtype, device=like.device))
    return _module().quant_linear


def quantized_floats(rng, qtype, n, k) -> torch.Tensor:
    """gguf-py's blocks of random floats, rows 0 and 2 and one block of row 1 all zero."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize
    values = torch.randn(n, k, generator=rng) * torch.rand(n, 1, generator=rng)
    values[0] = values[2] = 0
    values[1, 32:64] = 0
    return torch.from_numpy(quantize(values.numpy(), GGMLQuantizationType(int(qtype))))


def random_blocks(rng, qtype, n, k) -> torch.Tensor:
    """Random bytes with each block's scales replaced by sane ones (every 5th block's zero)."""
    elements, nbytes = BLOCKS[qtype]
    blocks = k // elements
    data = torch.randint(0, 256, (n, blocks, nbytes), generator=rng, dtype=torch.uint8)
    zero = torch.arange(n * blocks).view(n, blocks) % 5 == 0
    wide = qtype == QType.I4G
    for offset in SCALES[qtype]:
        scale = (torch.rand(n, blocks, generator=rng) - 0.5) / 16
        scale[zero] = 0
        scale = scale.half().float() if wide else scale.half()   # I4G: fp16 values in fp32
        data[..., offset:offset + (4 if wide else 2)] = scale[..., None].view(torch.uint8)
    return data.reshape(n, -1)


def check(quant_linear, weight, m, dtype, rng):
    x = torch.randn(m, weight.k, generator=rng).to(dtype)
    expected = x.double() @ weight.dequantize(torch.float64).T
    on_device = dataclasses.replace(weight, data=weight.data.to(DEVICE), perm=None
                                    if weight.perm is None else weight.perm.to(DEVICE))
    y = quant_linear(x.to(DEVICE), on_device)
    assert y.dtype == dtype and y.shape == expected.shape
    assert rel_error(y.cpu(), expected) < TOLERANCE[dtype]


DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qtype", list(QType))
def test_matches_dequantized_product(quant_linear, rng, qtype, dtype):
    k = 512 if qtype in (QType.Q4_K, QType.Q6_K) else 256
    weights = [QuantizedWeight(qtype, random_blocks(rng, qtype, 37, k), k)]
    if qtype in GGUF_QUANTIZE:
        weights.append(QuantizedWeight(qtype, quantized_floats(rng, qtype, 37, k), k))
    for weight in weights:
        for m in (1, 3, 17):
            check(quant_linear, weight, m, dtype, rng)


@pytest.mark.parametrize("qtype", list(QType))
def test_small_tiles_cross_rows_columns_and_blocks(quant_linear, monkeypatch, rng, qtype):
    """Tiles of 16 x 16 x 32: programs over both m and n, partial at the edges, and K types
    read a super-block 32 elements at a time."""
    monkeypatch.setattr(_module(), "tiles", lambda m, k: (16, 16, 32))
    weight = QuantizedWeight(qtype, random_blocks(rng, qtype, 37, 256), 256)
    check(quant_linear, weight, 17, torch.float32, rng)


@pytest.mark.parametrize("dtype", DTYPES)
def test_i4g_permuted_columns(quant_linear, rng, dtype):
    """desc_act: x[:, perm] multiplies the stored columns."""
    perm = torch.randperm(256, generator=rng)
    weight = QuantizedWeight(QType.I4G, random_blocks(rng, QType.I4G, 37, 256), 256, perm)
    for m in (1, 17):
        check(quant_linear, weight, m, dtype, rng)


def test_shapes_and_errors(quant_linear, rng):
    weight = QuantizedWeight(QType.Q8_0, random_blocks(rng, QType.Q8_0, 5, 64).to(DEVICE), 64)
    x = torch.randn(2, 3, 64, generator=rng).to(DEVICE)
    y = quant_linear(x, weight)
    assert y.shape == (2, 3, 5)
    assert torch.allclose(y[1], quant_linear(x[1], weight))
    assert torch.allclose(y, _module().quant_linear_ref(x, weight), rtol=1e-5, atol=1e-5)
    assert quant_linear(x[:0, 0], weight).shape == (0, 5)
    with pytest.raises(ValueError, match="x must be fp32, fp16 or bf16, got torch.float64"):
        quant_linear(x.double(), weight)
    with pytest.raises(ValueError, match=r"has 32 columns but the Q8_0 weight \(5, 64\)"):
        quant_linear(x[..., :32], weight)
    with pytest.raises(ValueError, match="perm must be int64"):
        quant_linear(x, dataclasses.replace(weight, perm=torch.arange(64, dtype=torch.int32,
                                                                      device=DEVICE)))


@pytest.mark.skipif(kernels_run_here(), reason="the Triton tests above run in this process")
def test_quant_linear_in_subprocess():
    run_in_interpreter(__file__, "not in_subprocess")
