"""kernels/paths.kernel_paths reports the kernel each op actually takes: the packed form a
PackableLinear ends up with, the dispatch predicates of attention, the norms and RoPE, under
each setting; and a model runner logs it once."""
from __future__ import annotations

import logging

import pytest
import torch

from pagedserve import envs, kernels
from pagedserve.kernels import native_linear, native_linear_q8, native_rope_store, paths
from pagedserve.workers.loader import load_config
from pagedserve.workers.model_runner import ModelRunner
from pagedserve.workers.models import layers
from pagedserve.workers.models.layers import PackableLinear
from pagedserve.workers.testing import make_tiny_llama

# the attribute a PackableLinear's packed weight lands in, by the kernel reported
_PACKED_INTO = {paths.LINEAR_F32: "panels", paths.LINEAR_BF16: "panels", paths.ONEDNN: "packed",
                paths.LINEAR_Q8: "q8", paths.F_LINEAR: None, "torch.mm": None}
_SETTINGS = [{}, {"fp32_linear": "native"}, {"fp32_linear": "onednn"},
             {"bf16_linear": "native"}, {"bf16_linear": "torch"}, {"prepack": False}]


def _linear(dtype, in_features=64):
    layer = PackableLinear()
    layer.weight = torch.nn.Parameter(torch.randn(40, in_features).to(dtype), requires_grad=False)
    return layer


def _packed_into(layer: PackableLinear) -> str | None:
    found = [name for name in ("panels", "packed", "q8") if getattr(layer, name) is not None]
    assert len(found) <= 1
    return found[0] if found else None


@pytest.mark.parametrize("settings", _SETTINGS, ids=lambda s: ",".join(
    f"{k}={v}" for k, v in s.items()) or "default")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_linear_and_lm_head_paths_are_the_packing_taken(settings, dtype):
    with envs.override(**settings):
        reported = paths.kernel_paths("cpu", dtype, hidden_size=64)
        layer = _linear(dtype)
        layer.prepack()
    assert _packed_into(layer) == _PACKED_INTO[reported["linear"].kernel]
    lm_head = reported["lm_head"].kernel
    assert lm_head == ("torch.mm" if reported["linear"].kernel == paths.F_LINEAR
                       else reported["linear"].kernel)


@pytest.mark.skipif(not native_linear_q8.available(), reason="native kernels unavailable")
@pytest.mark.parametrize("in_features", [64, 48])
def test_int8_paths_are_the_quantization_taken(in_features):
    reported = paths.kernel_paths("cpu", torch.float32, "int8", hidden_size=in_features)
    layer = _linear(torch.float32, in_features)
    quantized = layer.quantize_int8()
    assert reported["int8"].kernel == paths.LINEAR_Q8
    assert (reported["lm_head"].kernel == paths.LINEAR_Q8) == quantized == (in_features == 64)
    assert paths.kernel_paths("cpu", torch.float32)["int8"] == ("off", "--quantization none")


@pytest.mark.parametrize("decode_cpu", ["native", "bucketed", "ref"])
@pytest.mark.parametrize("dtype,cache_dtype,head_dim", [
    (torch.float32, torch.float32, 64), (torch.bfloat16, torch.bfloat16, 128),
    (torch.float32, torch.float8_e5m2, 40), (torch.float16, torch.float16, 64),
    (torch.float32, torch.float32, 320)])
def test_attention_paths_are_the_dispatch_taken(decode_cpu, dtype, cache_dtype, head_dim):
    q = torch.zeros(2, 4, head_dim, dtype=dtype)
    k_cache = torch.zeros(3, 16, 2, head_dim).to(cache_dtype)
    with envs.override(decode_cpu=decode_cpu):
        reported = paths.kernel_paths("cpu", dtype, kv_cache_dtype=cache_dtype, head_dim=head_dim)
        native_rows = kernels.native_decode_rows(q, k_cache)
        cpu_kernel = kernels.cpu_decode_kernel()
    decode, prefill = reported["decode attention"], reported["prefill attention"]
    assert decode.kernel.startswith("native") == native_rows
    assert prefill.kernel.startswith("native") == native_rows
    if decode_cpu != "native":
        assert (decode.kernel, cpu_kernel.__name__) in [
            ("torch reference", "paged_decode_attention_ref"),
            ("bucketed torch", "paged_decode_attention_cpu")]
    elif not native_rows:   # _decode_native falls back to the bucketed path, for this reason
        assert decode == ("bucketed torch", kernels._native_decode.unsupported_reason(
            "cpu", dtype, cache_dtype, head_dim))


def test_vector_body_named_is_the_one_built():
    if not kernels._native_decode.supports(torch.zeros(1, 1, 64), torch.zeros(1, 16, 1, 64)):
        pytest.skip("native decode attention unavailable")
    lanes = kernels._native_decode.vector_lanes()
    kernel = paths.kernel_paths("cpu", torch.float32)["decode attention"].kernel
    assert kernel == {16: "native (AVX-512 body)", 8: "native (AVX2 body)"}.get(
        lanes, "native (portable body)")
    assert paths.kernel_paths("cpu", torch.float32, head_dim=40)["decode attention"].kernel == \
        "native (portable body: head_dim 40)"
    wide = paths.kernel_paths("cpu", torch.float32, head_dim=256)["decode attention"].kernel
    assert wide == ("native (AVX-512 body)" if lanes == 16
                    else "native (portable body: head_dim 256)")


@pytest.mark.parametrize("switch", [True, False])
@pytest.mark.parametrize("dtype,cache_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.float32),
    (torch.float32, torch.float8_e4m3fn), (torch.float16, torch.float16)])
def test_elementwise_and_rope_paths_are_the_ones_taken(switch, dtype, cache_dtype):
    x, qkv = torch.zeros(3, 64, dtype=dtype), torch.zeros(3, 4 * 64, dtype=dtype)
    k_cache = torch.zeros(2, 16, 1, 64).to(cache_dtype)
    with envs.override(native_elementwise=switch):
        reported = paths.kernel_paths("cpu", dtype, kv_cache_dtype=cache_dtype)
        norm_native = layers._native_rows(x)          # what RMSNorm and silu_and_mul ask
        rope_native = layers.native_cpu_elementwise() and native_rope_store.supports(qkv, k_cache)
    assert (reported["rms_norm/silu"].kernel == "native elementwise.c") == norm_native
    assert (reported["rope+kv store"].kernel == "native rope_store.c") == rope_native
    if not switch:
        assert reported["rms_norm/silu"] == ("torch", "PAGEDSERVE_NATIVE_ELEMENTWISE=0")


def test_cuda_workers_report_triton_and_torch():
    reported = paths.kernel_paths("cuda", torch.bfloat16)
    assert reported["decode attention"] == reported["prefill attention"] == (
        "triton", "cuda tensors")
    assert reported["linear"] == (paths.F_LINEAR, "cuda tensors")
    assert reported["rms_norm/silu"].kernel == "torch"
    assert reported["rope+kv store"].kernel == "torch RoPE + triton store_kv"


def test_a_settings_change_drops_the_cached_choice():
    with envs.override(fp32_linear="onednn"):
        assert paths.fp32_linear().reason == "PAGEDSERVE_FP32_LINEAR=onednn"
    with envs.override(fp32_linear="native"):
        assert paths.fp32_linear().kernel == (paths.LINEAR_F32 if native_linear.available()
                                              else paths.ONEDNN)


def test_runner_logs_one_line_with_every_op(tmp_path, caplog):
    model_dir = make_tiny_llama(tmp_path / "tiny", num_layers=2)
    with caplog.at_level(logging.INFO, logger="pagedserve.workers.model_runner"):
        runner = ModelRunner(load_config(model_dir), model_dir, torch.float32, "cpu", 16, 8)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kernels rank")]
    assert len(lines) == 1
    config = runner.config
    reported = paths.kernel_paths("cpu", torch.float32, head_dim=config.head_dim,
                                  hidden_size=config.hidden_size)
    assert lines[0] == (f"kernels rank 0 (cpu, torch.float32, torch.float32 cache): "
                        f"{paths.describe(reported)}")
    assert all(f"; {op} -> " in lines[0] for op in list(reported)[1:])
    assert _packed_into(runner.model.lm_head_linear) == _PACKED_INTO[reported["lm_head"].kernel]
