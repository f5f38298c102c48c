"""The kernels and the layers take their settings from pagedserve.envs when they first need them,
never at import: importing them under invalid values succeeds, and nothing asked for the settings
yet; the first call that needs one fails naming the variable."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BAD = {"PAGEDSERVE_KERNELS": "cuda", "PAGEDSERVE_DECODE_CPU": "fast",
       "PAGEDSERVE_ATTENTION_THREADS": "many", "PAGEDSERVE_FP32_LINEAR": "fast",
       "PAGEDSERVE_BF16_LINEAR": "fast", "PAGEDSERVE_NATIVE_ELEMENTWISE": "yes",
       "PAGEDSERVE_PREPACK": "maybe"}
CODE = """
import pagedserve.kernels, pagedserve.kernels.native, pagedserve.kernels.paths
import pagedserve.kernels.native_decode_attention, pagedserve.kernels.native_elementwise
import pagedserve.workers.models.layers, pagedserve.workers.model_runner
from pagedserve import envs
assert envs._current is None, "a module read the settings at import"
import torch
try:
    pagedserve.kernels.paged_decode_attention(
        torch.zeros(1, 1, 8), torch.zeros(1, 16, 1, 8), torch.zeros(1, 16, 1, 8),
        torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1.0)
except ValueError as exc:
    print(exc)
"""


def test_importing_reads_no_setting_and_the_first_use_names_a_bad_one():
    env = dict(os.environ, **BAD)
    result = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True,
                            timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    variable, _ = result.stdout.split("=", 1)
    assert variable in BAD, result.stdout
