"""Prepacked linears: bf16 on oneDNN gives F.linear's numbers bit for bit, bf16 on the native
kernel and fp32 (native or oneDNN) to their rounding; which kernel each dtype takes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve import envs
from pagedserve.kernels import native_linear, paths
from pagedserve.workers.loader import load_config
from pagedserve.workers.model_runner import ModelRunner, SeqStep
from pagedserve.workers.models.layers import (PackableLinear, bf16_prepack_supported, prepack_linears,
                                   release_packed_weights)
from pagedserve.workers.testing import make_tiny_llama

needs_bf16_packing = pytest.mark.skipif(
    not bf16_prepack_supported(), reason="this CPU's oneDNN has no bf16 inner product")
needs_native = pytest.mark.skipif(not native_linear.available(),
                                  reason="native kernels unavailable")


@pytest.fixture(autouse=True)
def fresh_choices():
    """Kernel choices made from what the test patched in, and none left behind."""
    paths.clear_cache()
    yield
    paths.clear_cache()


def _linear(out_features, in_features, dtype):
    layer = PackableLinear()
    layer.weight = torch.nn.Parameter(torch.randn(out_features, in_features).to(dtype),
                                      requires_grad=False)
    return layer


@needs_bf16_packing
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_matmul_equals_f_linear_for_any_batch(rows):
    torch.manual_seed(rows)
    layer = _linear(96, 80, torch.bfloat16)
    x = torch.randn(rows, 80).to(torch.bfloat16)
    expected = F.linear(x, layer.weight)
    assert layer.prepack() and layer.packed is not None
    assert torch.equal(layer.matmul(x), expected)


@pytest.mark.parametrize("native", [pytest.param(True, marks=needs_native), False],
                         ids=["native", "onednn"])
@pytest.mark.parametrize("rows", [1, 7, 64, 300, 600])
def test_fp32_weights_pack_and_keep_f_linear_to_rounding(rows, native):
    # both kernels sum in another order than MKL's sgemm: equal up to fp32 rounding
    torch.manual_seed(rows)
    layer = _linear(100, 576, torch.float32)     # 100 outputs: a partial last panel
    x = torch.randn(rows, 576)
    expected = F.linear(x, layer.weight)
    with envs.override(fp32_linear="native" if native else "onednn"):
        assert layer.prepack() and layer.prepacked
    assert (layer.panels is not None) == native and (layer.packed is not None) != native
    torch.testing.assert_close(layer.matmul(x), expected, rtol=1e-5, atol=1e-4)


@needs_native
def test_fp32_linears_take_the_native_kernel_at_every_size(monkeypatch):
    calls = []
    kernel = native_linear.linear
    monkeypatch.setattr(native_linear, "linear",
                        lambda x, *a: calls.append(x.shape[0]) or kernel(x, *a))
    layer = _linear(96, 576, torch.float32)
    with envs.override(fp32_linear="native"):
        assert layer.prepack()
    for rows in (1, 64, 2048):
        layer.matmul(torch.randn(rows, 576))
    assert calls == [1, 64, 2048]


# dtype -> (setting, choice function, what the host offers -> patch, (setting, host, kernel)...)
_KERNEL_CHOICES = {
    "fp32": ("fp32_linear", paths.fp32_linear,
             lambda mp, host: mp.setattr(torch.backends.cpu, "get_cpu_capability", lambda: host),
             (("auto", "AVX2", paths.LINEAR_F32), ("auto", "AVX512", paths.ONEDNN),
              ("native", "AVX512", paths.LINEAR_F32), ("onednn", "AVX2", paths.ONEDNN))),
    "bf16": ("bf16_linear", paths.bf16_linear,   # host: oneDNN packs bf16
             lambda mp, host: mp.setattr(paths, "bf16_prepack_supported", lambda: host),
             (("auto", False, paths.LINEAR_BF16), ("auto", True, paths.ONEDNN),
              ("native", True, paths.LINEAR_BF16), ("torch", False, paths.F_LINEAR),
              ("torch", True, paths.ONEDNN))),
}


@pytest.mark.parametrize("dtype", list(_KERNEL_CHOICES))
def test_linear_kernel_choice(monkeypatch, dtype):
    setting, choice, offer, cases = _KERNEL_CHOICES[dtype]
    monkeypatch.setattr(native_linear, "available", lambda: True)
    for value, host, expected in cases:
        offer(monkeypatch, host)
        paths.clear_cache()
        with envs.override(**{setting: value}):
            assert choice().kernel == expected, (value, host)
    with pytest.raises(ValueError, match=f"PAGEDSERVE_{setting.upper()}='fast'"):
        with envs.override(**{setting: "fast"}):
            pass


def test_fp32_prefill_sized_inputs_take_mkl_on_the_onednn_path(monkeypatch):
    # from FP32_PACKED_MAX_ROWS rows on F.linear (MKL) is the faster one: the packed product
    # must not run at all
    layer = _linear(96, 576, torch.float32)
    with envs.override(fp32_linear="onednn"):
        assert layer.prepack()
    calls = []
    packed_op = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise",
                        lambda *a: calls.append(a[0].shape[0]) or packed_op(*a), raising=False)
    big = torch.randn(layer.FP32_PACKED_MAX_ROWS, 576)
    assert torch.equal(layer.matmul(big), F.linear(big, layer.weight))
    layer.matmul(big[:layer.FP32_PACKED_MAX_ROWS - 1])
    assert calls == [layer.FP32_PACKED_MAX_ROWS - 1]


def test_fp16_weights_stay_unpacked():
    layer = _linear(16, 8, torch.float16)
    assert not layer.prepack() and layer.packed is None


def test_bf16_weights_stay_unpacked_without_onednn_or_native_bf16(monkeypatch):
    monkeypatch.setattr(paths, "bf16_prepack_supported", lambda: False)
    layer = _linear(16, 8, torch.bfloat16)
    with envs.override(bf16_linear="torch"):
        assert not layer.prepack() and layer.packed is None
    x = torch.randn(3, 8).to(torch.bfloat16)
    assert torch.equal(layer.matmul(x), F.linear(x, layer.weight))


@needs_native
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_native_bf16_panels_keep_f_linear_to_a_bf16_rounding(rows):
    # both sum in fp32 and round once to bf16, in other orders: at most an ulp or so apart
    torch.manual_seed(rows)
    layer = _linear(100, 576, torch.bfloat16)    # 100 outputs: a partial last panel
    x = torch.randn(rows, 576).to(torch.bfloat16)
    expected = F.linear(x, layer.weight)
    with envs.override(bf16_linear="native"):
        assert layer.prepack() and layer.packed is None
    assert layer.panels is not None and layer.panels.dtype == torch.bfloat16
    out = layer.matmul(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), rtol=2.0 ** -7, atol=2e-2)
    assert float((out != expected).float().mean()) < 0.01      # measured 0 to 0.013%


ITEMS = [SeqStep(list(range(3, 20)), 0, [1, 0], True), SeqStep([5, 9], 0, [2], True)]


def _unpacked_and_packed_runners(tmp_path, dtype, tie=True):
    """Two runners of one tiny model: PAGEDSERVE_PREPACK=0, and the default."""
    model_dir = make_tiny_llama(tmp_path / "tiny", num_layers=2, tie=tie)
    config = load_config(model_dir)
    with envs.override(prepack=False):
        unpacked = ModelRunner(config, model_dir, dtype, "cpu", 16, 8)
    return unpacked, ModelRunner(config, model_dir, dtype, "cpu", 16, 8)


@needs_bf16_packing
def test_runner_packs_every_projection_and_keeps_its_logits(tmp_path):
    unpacked, packed = _unpacked_and_packed_runners(tmp_path, torch.bfloat16)
    assert all(m.packed is not None for m in packed.model.modules()
               if isinstance(m, PackableLinear))
    assert all(m.packed is None for m in unpacked.model.modules()
               if isinstance(m, PackableLinear))
    assert torch.equal(packed.execute(ITEMS).clone(), unpacked.execute(ITEMS).clone())
    assert prepack_linears(unpacked.model) == 2 * 4 + 1  # qkv, o, gate_up, down per layer; LM head
    assert torch.equal(unpacked.execute(ITEMS).clone(), packed.execute(ITEMS).clone())


@needs_native
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_runner_releases_the_plain_weights_the_panels_replace(tmp_path, tie):
    with envs.override(fp32_linear="native"):
        plain, packed = _unpacked_and_packed_runners(tmp_path, torch.float32, tie)
    pairs = [(p, q) for p, q in zip(plain.model.modules(), packed.model.modules())
             if isinstance(q, PackableLinear)]
    released = [q for _, q in pairs if q.weight.is_meta]
    # the per-layer projections; the LM head's weight has another holder (the embedding table,
    # or the model's lm_head parameter) and stays
    assert len(released) == 2 * 4 and not packed.model.lm_head_linear.weight.is_meta
    assert all(p.weight.shape == q.weight.shape and p.weight.dtype == q.weight.dtype
               and q.panels is not None for p, q in pairs)
    torch.testing.assert_close(packed.execute(ITEMS).clone(), plain.execute(ITEMS).clone(),
                               rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="plain copy was released"):
        released[0].matmul(torch.randn(2, released[0].weight.shape[1], dtype=torch.float64))
    assert release_packed_weights(plain.model) == 0             # nothing packed, nothing freed
