"""Issue #20's acceptance on the real checkpoints of the new families (fp32, dequantized from their
GGUFs): 8 ShareGPT prompts batched in every step, fed in chunks of 7 tokens, shuffled
non-contiguous block tables, 16 greedy tokens each equal to transformers' own greedy decode.
Both families' tensor-parallel splits are tested at tp 2 on tiny models of the real ones' head
layouts (test_model_families.py::test_tp2_equals_tp1: Qwen2's 2 kv heads, one a rank; Gemma 3's
q heads over one kv head that both ranks hold, head_dim 256), which saves the suite two more
loads of each real model."""
from __future__ import annotations

from itertools import islice

import pytest

from pagedserve.pipeline.tokenizer import load_tokenizer
from pagedserve.workers.loader import load_config, resolve_model
from pagedserve.workers.testing import hf_greedy
from test_worker_core import make_core, run_greedy

from script_module import load_script

pytestmark = pytest.mark.slow

PROMPT_TOKENS = 40       # each ShareGPT turn cut to its first 40 tokens: the test's cost
NEW_TOKENS = 16         # the greedy paths part within a few tokens when they part at all
NUM_BLOCKS = 8 * 5 + 11


@pytest.fixture(scope="module")
def sharegpt_texts() -> list[str]:
    turns = load_script("sharegpt").first_turns()
    return [human for human, _ in islice((t for t in turns if len(t[0]) > 80), 8)]


@pytest.mark.parametrize("name,architecture", [("Qwen2.5-Coder-0.5B-Instruct", "qwen2"),
                                               ("gemma-3-270m", "gemma3")])
def test_builtin_greedy_equals_transformers(name, architecture, sharegpt_texts):
    model_dir = resolve_model(name)
    assert load_config(model_dir).architecture == architecture
    tokenizer = load_tokenizer(model_dir)
    prompts = [tokenizer.encode(text)[:PROMPT_TOKENS] for text in sharegpt_texts]
    core = make_core(model_dir, num_blocks=NUM_BLOCKS)
    ours = run_greedy(core.execute, prompts, NEW_TOKENS, chunk=7, num_blocks=NUM_BLOCKS, seed=13)
    del core
    assert ours == hf_greedy(model_dir, prompts, NEW_TOKENS)
