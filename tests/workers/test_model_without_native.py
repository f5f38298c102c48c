"""A whole model with no native library at all (CC names a compiler that does not exist, and the
cache is fresh, so no feature builds or loads): every op takes its torch path, the kernel-path
report says so and why, and greedy decoding through ModelRunner / WorkerCore still equals
transformers'. Run in a subprocess, so that nothing native was ever loaded in it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from pagedserve.kernels import paths

ROOT = Path(__file__).resolve().parents[2]

_RUN = """
import json, sys
import numpy as np, torch
from test_worker_core import make_core, run_greedy
from pagedserve.kernels import native, paths
from pagedserve.workers.testing import hf_greedy, make_tiny_llama

model_dir = make_tiny_llama(sys.argv[1], seed=5)
rng = np.random.default_rng(2)
prompts = [rng.integers(3, 512, n).tolist() for n in (12, 30, 3, 47)]
core = make_core(model_dir)
config = core.runner.config
print(json.dumps({
    "ours": run_greedy(core.execute, prompts, 12), "expected": hf_greedy(model_dir, prompts, 12),
    "paths": paths.kernel_paths("cpu", torch.float32, head_dim=config.head_dim,
                                hidden_size=config.hidden_size),
    "reasons": {name: native.unavailable_reason(name) for name in native.FEATURES}}))
"""

# what each op reports with no native library (linear and lm_head: oneDNN's packed product,
# or F.linear / torch.mm where torch has no oneDNN)
TORCH_KERNELS = {
    "linear": {paths.ONEDNN, paths.F_LINEAR}, "lm_head": {paths.ONEDNN, "torch.mm"},
    "decode attention": {"bucketed torch"},
    "prefill attention": {"torch reference (gather + SDPA)"},
    "rms_norm/silu": {"torch"}, "rope+kv store": {"torch RoPE + torch store_kv"},
}


def test_model_without_native_kernels_equals_transformers(tmp_path):
    compiler = tmp_path / "no-such-compiler"
    cache = tmp_path / "cache"
    env = dict(os.environ, CC=str(compiler), PAGEDSERVE_CACHE=str(cache),
               PYTHONPATH=str(ROOT / "tests" / "workers"))
    result = subprocess.run([sys.executable, "-c", _RUN, str(tmp_path / "tiny")], env=env,
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    for name, reason in report["reasons"].items():
        assert reason is not None and reason.startswith(
            f"native {name} kernels unavailable: ") and str(compiler) in reason, (name, reason)
    reported = report["paths"]
    assert reported.pop("int8") == ["off", "--quantization none"]
    assert reported.keys() == TORCH_KERNELS.keys()
    for op, (kernel, why) in reported.items():
        assert kernel in TORCH_KERNELS[op] and str(compiler) in why, (op, kernel, why)
    assert list(cache.glob("kernels/**/*.so")) == []            # nothing was built
    assert report["ours"] == report["expected"]
