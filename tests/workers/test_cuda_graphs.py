"""Decode steps through DecodeGraphs' static, padded buffers (eagerly on CPU: capture=False) give
the same logits as the runner's own eager path, and padded rows never store K/V."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve.workers.cuda_graphs import DecodeGraphs, graph_batch_sizes
from pagedserve.workers.loader import load_config
from pagedserve.workers.model_runner import ModelRunner, SeqStep
from pagedserve.workers.testing import make_tiny_llama

BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS = 16, 64, 8


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"), seed=4, num_heads=6, num_kv_heads=2,
                           hidden_size=96)


def make_runner(model_dir, graphs: bool) -> ModelRunner:
    runner = ModelRunner(load_config(model_dir), model_dir, torch.float32, "cpu", BLOCK_SIZE,
                         NUM_BLOCKS)
    assert runner.decode_graphs is None           # CPU runners never capture
    if graphs:
        runner.decode_graphs = DecodeGraphs(runner.model, runner.kv_cache, 8, MAX_BLOCKS,
                                            capture=False)
    return runner


def test_graph_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert graph_batch_sizes(100) == [1, 2, 4, 8, 16, 32, 64, 96, 100]
    assert graph_batch_sizes(256) == [1, 2, 4, 8, 16, 32, *range(64, 257, 32)]
    with pytest.raises(ValueError, match="max_batch >= 1"):
        DecodeGraphs(None, torch.zeros(1), 0, 4, capture=False)


def test_padded_decode_steps_match_eager(tiny_dir):
    eager, padded = make_runner(tiny_dir, False), make_runner(tiny_dir, True)
    rng = np.random.default_rng(1)
    blocks = rng.permutation(NUM_BLOCKS).tolist()
    prompts = [rng.integers(3, 512, n).tolist() for n in (5, 17, 30, 2, 44)]
    tables = [blocks[4 * i:4 * i + 4] for i in range(5)]
    lens = [len(p) for p in prompts]
    prefill = [SeqStep(p, 0, t, True) for p, t in zip(prompts, tables)]
    for runner in (eager, padded):
        runner.execute(prefill)
    graphs = padded.decode_graphs
    # 5 sequences (padded to 8), then 3 (the same padded size: rows 3..7 are stale), then 1, then
    # all 5 again with one that does not sample.
    for step, seqs in enumerate(([0, 1, 2, 3, 4], [4, 0, 2], [3], [0, 1, 2, 3, 4])):
        items = [SeqStep([int(rng.integers(3, 512))], lens[s], tables[s], not (step == 3 and s == 1))
                 for s in seqs]
        want, got = eager.execute(items).clone(), padded.execute(items).clone()
        assert got.shape == want.shape == (sum(it.sample for it in items), 512)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        n = len(items)
        size = next(s for s in graphs.sizes if s >= n)
        assert (graphs.slots[n:size] == -1).all() and (graphs.context_lens[n:size] == 1).all()
        for s in seqs:
            lens[s] += 1
    torch.testing.assert_close(padded.kv_cache, eager.kv_cache, rtol=1e-5, atol=1e-5)


def test_steps_the_graphs_cannot_take_run_eagerly(tiny_dir):
    """A prefill chunk, more sequences than the largest graph, or a table wider than the graphs'
    buffers go through the eager path (the graphs' buffers stay untouched)."""
    runner = make_runner(tiny_dir, True)
    graphs = runner.decode_graphs
    graphs.input_ids.fill_(-7)
    runner.execute([SeqStep(list(range(3, 12)), 0, [0], True)])                  # prefill
    runner.execute([SeqStep([5], i, [i + 1], True) for i in range(9)])           # 9 > 8 rows
    runner.execute([SeqStep([5], 16 * MAX_BLOCKS, list(range(MAX_BLOCKS + 1)), True)])  # too wide
    assert (graphs.input_ids == -7).all()
    runner.execute([SeqStep([5], 9, [0], True)])
    assert graphs.input_ids[0] == 5
