"""Issue #20's acceptance on the real checkpoints of the new families (fp32, dequantized from their
GGUFs): 8 ShareGPT prompts batched in every step, fed in chunks of 7 tokens, shuffled
non-contiguous block tables, 16 greedy tokens each equal to transformers' own greedy decode; and
two tensor-parallel ranks equal to one on Qwen2.5-0.5B (14 q / 2 kv heads, one kv head a rank).
Gemma 3's split (its q heads over one kv head, which both ranks hold) is tested at tp 2 on a
tiny Gemma 3 with one kv head and head_dim 256 like the 270M's
(test_model_families.py::test_tp2_equals_tp1), which saves the suite two loads of the 270M."""
from __future__ import annotations

from itertools import islice

import pytest

from pagedserve.pipeline.tokenizer import load_tokenizer
from pagedserve.workers.loader import load_config, resolve_model
from pagedserve.workers.testing import hf_greedy
from pagedserve.workers.tp_launch import RankSpec, TPWorkers
from test_worker_core import make_core, run_greedy

from tests.script_module import load_script

pytestmark = pytest.mark.slow

PROMPT_TOKENS = 40       # each ShareGPT turn cut to its first 40 tokens: the test's cost
NEW_TOKENS = 16         # the greedy paths part within a few tokens when they part at all
NUM_BLOCKS = 8 * 5 + 11


@pytest.fixture(scope="module")
def sharegpt_texts() -> list[str]:
    turns = load_script("sharegpt").first_turns()
    return [human for human, _ in islice((t for t in turns if len(t[0]) > 80), 8)]


@pytest.mark.parametrize("name,architecture,tp2", [("Qwen2.5-Coder-0.5B-Instruct", "qwen2", True),
                                                   ("gemma-3-270m", "gemma3", False)])
def test_builtin_greedy_equals_transformers_and_tp2(name, architecture, tp2, sharegpt_texts):
    model_dir = resolve_model(name)
    assert load_config(model_dir).architecture == architecture
    tokenizer = load_tokenizer(model_dir)
    prompts = [tokenizer.encode(text)[:PROMPT_TOKENS] for text in sharegpt_texts]
    core = make_core(model_dir, num_blocks=NUM_BLOCKS)
    ours = run_greedy(core.execute, prompts, NEW_TOKENS, chunk=7, num_blocks=NUM_BLOCKS, seed=13)
    del core
    assert ours == hf_greedy(model_dir, prompts, NEW_TOKENS)
    if not tp2:
        return
    with TPWorkers(RankSpec(str(model_dir), num_blocks=NUM_BLOCKS), tp_size=2,
                   timeout_s=600) as workers:
        assert run_greedy(workers.execute, prompts, NEW_TOKENS, chunk=7,
                          num_blocks=NUM_BLOCKS, seed=13) == ours
