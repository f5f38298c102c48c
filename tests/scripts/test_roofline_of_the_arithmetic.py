"""bench_step and bench_throughput measure an int8 run against the int8 linear's roofline (not
fp32's), and say in the JSON which roofline they used."""
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_step  # noqa: E402

# Every in_features a multiple of 32, as int8 needs; small enough to time in a blink.
TINY = SimpleNamespace(hidden_size=64, head_dim=16, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128, num_hidden_layers=2, vocab_size=256)


def test_roofline_takes_int8s_rate_under_int8_only():
    rates = {"torch": 100e9, "engine": 140e9, "int8": 220e9, "params": 10}
    flops, name = bench_step.roofline(rates, torch.float32, 256, "int8")
    assert flops == 220e9 and "int8" in name and "native_linear_q8" in name
    flops, name = bench_step.roofline(rates, torch.float32, 256, "none")
    assert flops == 140e9 and name.startswith("float32 matmuls at 256 rows")
    slower_int8 = {**rates, "int8": 50e9}  # int8's own rate even when it is the slower one
    assert bench_step.roofline(slower_int8, torch.float32, 256, "int8")[0] == 50e9


def test_matmul_rates_times_the_int8_linear():
    from pagedserve.kernels import native_linear_q8
    if not native_linear_q8.available():
        pytest.skip("the native int8 kernel is not built here")
    rates = bench_step.matmul_rates(TINY, 8, torch.float32, "cpu", "int8")
    assert rates["int8"] > 0 and rates["engine"] > 0 and rates["torch"] > 0
    assert "int8" not in bench_step.matmul_rates(TINY, 8, torch.float32, "cpu")


def test_bench_throughput_roofline_names_the_int8_one():
    import bench_throughput
    from pagedserve.kernels import native_linear_q8
    if not native_linear_q8.available():
        pytest.skip("the native int8 kernel is not built here")
    tok_s, flops, torch_flops, name = bench_throughput.roofline_tok_s(
        TINY, torch.float32, "cpu", 8, "int8")
    params = sum(i * o * c for i, o, c in bench_step.linear_shapes(TINY))
    assert "int8" in name and tok_s == pytest.approx(flops / (2 * params))
    assert torch_flops > 0
