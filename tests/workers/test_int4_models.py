"""AWQ and GPTQ checkpoints served kept in int4 (#21): a tiny Llama quantized in each layout
(tests/workers/int4_fixtures.py), run by the model runner with --quantization auto (the native
kernels multiply the int4 blocks, x quantized per call to int8 blocks of 32), against the same
model with each linear replaced by its exact dequantization, run in fp32 by us and by
transformers. The only difference left is the activations' int8 rounding. Tolerances: the
kernels' logits equal the same model computed by torch with the same quantized arithmetic
(native_linear_gguf.linear_exact_ref) to 1e-5 of the largest logit (rounding of layers
recomputed in another order only), and the dequantized fp32 reference (ours = transformers') to
5% of its largest logit (measured 1.6-3.3% on these random models, std 0.1)."""
from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import native_linear_gguf
from pagedserve.workers.loader import load_config, weights_quantization
from pagedserve.workers.model_runner import ModelRunner, SeqStep
from pagedserve.workers.models.quantized import QuantizedMatmul
from pagedserve.workers.testing import hf_model
from int4_fixtures import write_quantized_llama
from test_model import all_row_logits

pytestmark = pytest.mark.skipif(not native_linear_gguf.available(),
                                reason="native kernels unavailable")
BLOCK_SIZE = 16
CASES = [("awq", 128, True, False), ("awq", 32, False, False), ("gptq", 64, True, False),
         ("gptq", 128, False, True), ("gptq", 32, True, True)]


def runner(model_dir, quantization: str) -> ModelRunner:
    return ModelRunner(load_config(model_dir), model_dir, torch.float32, "cpu", BLOCK_SIZE, 8,
                       quantization=quantization)


@pytest.mark.parametrize("method,group,sym,desc_act", CASES,
                         ids=[f"{m}-g{g}-{'sym' if s else 'asym'}{'-desc' if d else ''}"
                              for m, g, s, d in CASES])
def test_int4_logits_match_the_dequantized_reference(tmp_path, method, group, sym, desc_act):
    quantized = write_quantized_llama(tmp_path / "q", method, group, sym=sym, desc_act=desc_act,
                                      reference_dir=tmp_path / "ref", std=0.1)
    assert weights_quantization("auto", quantized) == method
    ours = runner(quantized, "auto")
    kept = [m for m in ours.model.modules() if getattr(m, "quantized", None) is not None]
    assert len(kept) == 2 * 4       # qkv, o, gate_up, down per layer; the LM head stays fp16
    if desc_act:
        assert any(w.perm is not None for m in kept for _, w in m.quantized.segments)
    tokens = torch.randint(3, 512, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    items = [SeqStep(tokens, 0, [0, 1, 2], True)]
    got, _ = all_row_logits(ours, items)
    want, _ = all_row_logits(runner(tmp_path / "ref", "none"), items)
    with torch.no_grad():
        hf = hf_model(tmp_path / "ref")(torch.tensor([tokens])).logits[0]
    assert torch.allclose(want, hf, atol=1e-4, rtol=1e-4)     # the reference is transformers'
    err = float((got - want).abs().max() / want.abs().max())
    print(f"{method} g{group}: max |diff| {err:.4f} of the largest logit")
    assert err < 0.05, err
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(QuantizedMatmul, "__call__", lambda self, x: torch.cat(
            [native_linear_gguf.linear_exact_ref(x, w) for _, w in self.segments], dim=1))
        same, _ = all_row_logits(ours, items)
    assert float((got - same).abs().max()) <= 1e-5 * float(same.abs().max())


def test_a_named_format_that_is_not_the_checkpoints_is_refused(tmp_path):
    quantized = write_quantized_llama(tmp_path / "q", "awq", 64)
    with pytest.raises(ValueError, match="--quantization gptq: .* holds awq weights"):
        runner(quantized, "gptq")
    with pytest.raises(ValueError, match="--quantization gguf: .* holds awq weights"):
        runner(quantized, "gguf")
    plain = runner(quantized, "none")    # dequantized at load, fp32 linears
    assert not any(getattr(m, "quantized", None) for m in plain.model.modules())
