"""A bf16 model on a CPU without bf16 math: its linears run on kernels/native/linear_bf16.c
(bf16 weights widened in registers, fp32 sums), its norms, SiLU and RoPE on the native bf16
kernels, and it predicts like torch's own bf16 model."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pagedserve import envs
from pagedserve.kernels import native_linear
from test_quantization import BLOCK_SIZE, TEXT, prefill_logits
from pagedserve.workers.loader import TEST_MODEL, load_config, resolve_model
from pagedserve.pipeline.tokenizer import load_tokenizer
from pagedserve.workers.model_runner import ModelRunner
from pagedserve.workers.models import layers

pytestmark = pytest.mark.skipif(not native_linear.available(),
                                reason="native kernels unavailable")


def test_smollm2_bf16_on_native_kernels_predicts_like_torch_bf16():
    """Teacher-forced on ordinary text, measured here: perplexity fp32 26.553, native bf16
    26.712, torch bf16 26.640; argmax agreement with fp32 96.1% (torch bf16: 97.5%), with torch
    bf16 98.5%; logits 1.5% off fp32's (torch bf16: 1.4%)."""
    model_dir = resolve_model(TEST_MODEL)
    tokens = load_tokenizer(model_dir).encode(TEXT)
    blocks = -(-len(tokens) // BLOCK_SIZE)

    def logits(dtype):
        run = ModelRunner(load_config(model_dir), model_dir, dtype, "cpu", BLOCK_SIZE, blocks)
        panels = [m.panels for m in run.model.modules() if isinstance(m, layers.PackableLinear)
                  and m.panels is not None and m.panels.dtype == torch.bfloat16]
        return prefill_logits(run, tokens).float(), len(panels)

    exact, _ = logits(torch.float32)
    with envs.override(bf16_linear="native"):
        native, packed = logits(torch.bfloat16)
    assert packed == 30 * 4 + 1                         # every projection and the LM head
    # torch's F.linear on plain bf16 weights, and torch's norm, silu, rope
    with envs.override(prepack=False, native_elementwise=False):
        reference, packed = logits(torch.bfloat16)
    assert packed == 0

    target = torch.tensor(tokens[1:])
    ppl = {name: math.exp(float(F.cross_entropy(value[:-1], target)))
           for name, value in (("fp32", exact), ("native", native), ("torch", reference))}
    assert ppl["native"] < ppl["fp32"] * 1.02, ppl
    assert float((native - exact).norm() / exact.norm()) < 0.03
    for other in (exact, reference):
        assert float((native.argmax(-1) == other.argmax(-1)).float().mean()) > 0.9
