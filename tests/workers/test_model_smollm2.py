"""Issue 3's acceptance on the real SmolLM2-135M-Instruct (fp32): 8 prompts batched together in
every step, fed in chunks of 7 tokens, block size 16, shuffled non-contiguous block tables,
32 greedy tokens each, exactly transformers' own greedy decode."""
from __future__ import annotations

import pytest

from test_worker_core import make_core, run_greedy
from pagedserve.workers.loader import TEST_MODEL, resolve_model
from pagedserve.pipeline.tokenizer import load_tokenizer
from pagedserve.workers.testing import hf_greedy

PROMPTS = [
    "The capital of France is",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Once upon a time, in a small village by the sea, there lived",
    "Explain in two sentences why the sky is blue.",
    "List three fruits:",
    "What is 17 times 23?",
    "Translate to French: Good morning, how are you today?",
    "The quick brown fox",
]


@pytest.mark.slow
def test_smollm2_greedy_32_tokens_match_transformers():
    model_dir = resolve_model(TEST_MODEL)
    tokenizer = load_tokenizer(model_dir)
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    core = make_core(model_dir, num_blocks=8 * 6 + 13)
    ours = run_greedy(core.execute, prompts, 32, chunk=7, num_blocks=8 * 6 + 13, seed=11)
    assert ours == hf_greedy(model_dir, prompts, 32)
