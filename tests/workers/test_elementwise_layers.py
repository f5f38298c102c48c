"""RMSNorm (with the residual add fused in) and silu_and_mul: which inputs take the native fp32
and bf16 kernels, the torch path's exact numbers elsewhere, and a model's logits either way."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from pagedserve import envs
from pagedserve.kernels import native_elementwise
from pagedserve.workers.loader import load_config
from pagedserve.workers.model_runner import ModelRunner, SeqStep
from pagedserve.workers.models import layers
from pagedserve.workers.models.layers import RMSNorm, silu_and_mul
from pagedserve.workers.testing import make_tiny_llama

needs_native = pytest.mark.skipif(not native_elementwise.available(),
                                  reason="the native kernels cannot be built here")


@pytest.fixture
def native_switch():
    """set(on): PAGEDSERVE_NATIVE_ELEMENTWISE for the rest of the test."""
    with contextlib.ExitStack() as stack:
        yield lambda on: stack.enter_context(envs.override(native_elementwise=on))


@pytest.fixture
def native_calls(monkeypatch):
    """Names of the native_elementwise functions called, in order (they still compute)."""
    calls = []
    for name in ("rms_norm", "fused_add_rms_norm", "silu_mul"):
        kernel = getattr(native_elementwise, name)
        monkeypatch.setattr(native_elementwise, name,
                            lambda *a, _k=kernel, _n=name, **kw: calls.append(_n) or _k(*a, **kw))
    return calls


def _norm(dtype):
    norm = RMSNorm(64, 1e-5, dtype, "cpu")
    norm.weight.copy_(torch.randn(64))
    return norm


def test_switch_follows_the_setting_and_each_kernel_its_own_library(native_switch,
                                                                      monkeypatch):
    x = torch.randn(3, 8)
    native_switch(False)
    assert layers.native_cpu_elementwise() is False and not layers._native_rows(x)
    native_switch(True)
    assert layers.native_cpu_elementwise() is True
    assert layers._native_rows(x) is native_elementwise.available()
    monkeypatch.setattr(native_elementwise, "available", lambda: False)   # its build failed
    assert not layers._native_rows(x)
    with pytest.raises(ValueError, match="PAGEDSERVE_NATIVE_ELEMENTWISE='yes'"):
        envs.from_environ({"PAGEDSERVE_NATIVE_ELEMENTWISE": "yes"})


@needs_native
def test_fp32_rows_take_the_native_kernels(native_switch, native_calls):
    native_switch(True)
    norm, x, residual = _norm(torch.float32), torch.randn(5, 64), torch.randn(5, 64)
    expected_residual = residual + x
    out = norm(x)
    torch.testing.assert_close(out, F.rms_norm(x, (64,), norm.weight, 1e-5), rtol=2e-6, atol=1e-6)
    out, updated = norm(x, residual)
    assert updated is residual and torch.equal(residual, expected_residual)
    torch.testing.assert_close(out, F.rms_norm(expected_residual, (64,), norm.weight, 1e-5),
                               rtol=2e-6, atol=1e-6)
    gate_up = torch.randn(5, 128)
    torch.testing.assert_close(silu_and_mul(gate_up), F.silu(gate_up[:, :64]) * gate_up[:, 64:],
                               rtol=1e-6, atol=1e-30)
    assert native_calls == ["rms_norm", "fused_add_rms_norm", "silu_mul"]


@pytest.mark.parametrize("dtype,switch_on,shape", [
    (torch.float16, True, (5, 64)), (torch.float32, False, (5, 64)),
    (torch.float32, True, (2, 5, 64))])   # fp16, switched off, not 2-D rows: torch
def test_other_inputs_take_torch_with_its_exact_numbers(native_switch, native_calls, dtype,
                                                        switch_on, shape):
    native_switch(switch_on)
    norm = _norm(dtype)
    x, residual = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    expected_residual = x + residual
    assert torch.equal(norm(x), F.rms_norm(x, (64,), norm.weight, 1e-5))
    out, updated = norm(x, residual)
    assert updated is residual and torch.equal(residual, expected_residual)
    assert torch.equal(out, F.rms_norm(expected_residual, (64,), norm.weight, 1e-5))
    gate_up = torch.randn(*shape[:-1], 128).to(dtype)
    assert torch.equal(silu_and_mul(gate_up), F.silu(gate_up[..., :64]) * gate_up[..., 64:])
    assert native_calls == []


@needs_native
def test_strided_rows_fall_back_to_torch(native_switch, native_calls):
    native_switch(True)
    norm = _norm(torch.float32)
    x = torch.randn(64, 5).t()                      # columns: the kernel needs contiguous rows
    assert torch.equal(norm(x), F.rms_norm(x, (64,), norm.weight, 1e-5))
    assert native_calls == []


@needs_native
def test_bf16_rows_take_the_native_kernels_with_torch_bf16_numbers(native_switch, native_calls):
    native_switch(True)
    norm = _norm(torch.bfloat16)
    x, residual = torch.randn(5, 64).bfloat16(), torch.randn(5, 64).bfloat16()
    expected_residual = residual + x
    torch.testing.assert_close(norm(x), F.rms_norm(x, (64,), norm.weight, 1e-5),
                               rtol=2 ** -7, atol=1e-6)
    out, updated = norm(x, residual)
    assert updated is residual and torch.equal(residual, expected_residual)
    torch.testing.assert_close(out, F.rms_norm(expected_residual, (64,), norm.weight, 1e-5),
                               rtol=2 ** -7, atol=1e-6)
    gate_up = torch.randn(5, 128).bfloat16()
    torch.testing.assert_close(silu_and_mul(gate_up), F.silu(gate_up[:, :64]) * gate_up[:, 64:],
                               rtol=2 ** -7, atol=1e-6)
    assert native_calls == ["rms_norm", "fused_add_rms_norm", "silu_mul"]


@needs_native
# bf16: the native RoPE rounds once where torch rounds twice, and the random std-0.3 weights
# amplify that ulp: measured 0.14 at most, on logits up to ~7
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 0.3)])
def test_model_logits_match_with_and_without_the_native_kernels(tmp_path, native_switch,
                                                              native_calls, dtype, tol):
    model_dir = make_tiny_llama(tmp_path / "tiny", num_layers=2)
    config = load_config(model_dir)
    items = [SeqStep(list(range(3, 20)), 0, [1, 0], True), SeqStep([5, 9], 0, [2], True)]
    logits = {}
    for on in (False, True):
        native_switch(on)
        # eager: where the replay takes fp32 steps (its linears' path, AVX2 hosts) it calls
        # the kernels itself, not these layers (tests/workers/test_cpu_decode_replay.py)
        with envs.override(cpu_decode_replay=False):
            logits[on] = ModelRunner(config, model_dir, dtype, "cpu", 16, 8).execute(
                items).clone()
        # on: two norms per layer and the final one, one silu_mul per layer
        assert len(native_calls) == (2 * 2 + 1 + 2 if on else 0)
    torch.testing.assert_close(logits[True], logits[False], rtol=tol, atol=tol)
