"""scripts/bench_isa_limits.py: the AVX2 inner loops compile and run, and the kernels beside them."""
import platform

import pytest

from pagedserve.kernels import native
from script_module import load_script


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="AVX2 loops: x86-64")
def test_each_loop_and_kernel_reports_a_rate():
    if native.variant_unavailable_reason("avx2") is not None:
        pytest.skip(f"no AVX2 build here: {native.variant_unavailable_reason('avx2')}")
    script = load_script("bench_isa_limits")
    try:
        report = script.main(["--rows", "2", "--repeats", "1", "--iters", "2000", "--no-store"])
    finally:
        native.select_variant(None)
    for name in script.SHAPES:
        row = report[name]
        assert row["loop"] > 0 and row["kernel"] > 0, row
        assert row["kernel_share"] == pytest.approx(row["kernel"] / row["loop"], abs=2e-3)
    assert report["int16_loop"] > 0
