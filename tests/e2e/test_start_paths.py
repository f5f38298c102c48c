"""`scripts/launch.sh --model DIR` from the repository root, as the README starts it, serving a
Hugging Face checkpoint directory (safetensors, and GPTQ int4) with Hugging Face's `kernels`
installed: the root's own kernels/ folder once shadowed it, and every HF checkpoint was refused
at start (issue 45). The default model's start path (`scripts/launch.sh`, no --model) is
tests/e2e/test_builtin_models_http.py's Qwen group."""
from __future__ import annotations

import importlib.util

import httpx
import pytest

from pagedserve.pipeline.ingress.testing import make_tiny_tokenizer
from pagedserve.workers.testing import hf_greedy, make_tiny_llama
from faults.conftest import Group
from int4_fixtures import write_quantized_llama

pytestmark = pytest.mark.slow
PROMPT = [5, 9, 3, 77, 21, 8]


def _served_greedy(model_dir, reference_dir) -> None:
    assert importlib.util.find_spec("kernels") is not None, "Hugging Face's kernels is not installed"
    group = Group(model_dir, http=True, launch_sh=True,
                  extra=("--served-model-name", "tiny", "--max-model-len", "256"))
    try:
        answer = httpx.post(f"http://127.0.0.1:{group.port}/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True})
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        assert choice["token_ids"] == hf_greedy(reference_dir, [PROMPT], max_new_tokens=6)[0]
    finally:
        assert group.close() == 0


def test_launch_sh_serves_a_safetensors_directory(tmp_path):
    model_dir = make_tiny_llama(tmp_path / "tiny", seed=11, vocab_size=259)
    make_tiny_tokenizer().save_pretrained(model_dir)
    _served_greedy(model_dir, model_dir)


def test_launch_sh_serves_a_gptq_directory(tmp_path):
    reference = tmp_path / "reference"
    model_dir = write_quantized_llama(tmp_path / "gptq", "gptq", group_size=32, vocab_size=259,
                                      dtype=__import__("torch").float32, reference_dir=reference)
    make_tiny_tokenizer().save_pretrained(model_dir)
    _served_greedy(model_dir, reference)
