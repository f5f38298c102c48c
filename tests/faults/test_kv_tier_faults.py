"""The disk KV tier under faults, with real process groups on a tiny random model: a worker
killed while its writer thread stores blocks, and one killed while blocks load back after a
restart of the whole group - the greedy tokens are those of a group without tiers."""
from __future__ import annotations

import numpy as np
import pytest

from faults.conftest import Group, token_ids
from pagedserve.pipeline import SamplingParams
from pagedserve.pipeline.ingress.testing import make_tiny_tokenizer
from pagedserve.workers.testing import make_tiny_llama

pytestmark = pytest.mark.slow

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# A pool of 32 blocks of 16 tokens (the tiny model's blocks are 8 KiB), two sequences at once.
SMALL = ("--kv-cache-memory", "256KiB", "--max-num-seqs", "2", "--swap-space", "0")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_llama(tmp_path_factory.mktemp("tiny"), seed=3, vocab_size=259)
    make_tiny_tokenizer().save_pretrained(path)
    return path


def _prompts():
    """Eight prompts of 100-160 tokens, pairs sharing their first 96."""
    rng = np.random.default_rng(5)
    shared = [rng.integers(3, 256, 96).tolist() for _ in range(4)]
    return [shared[i // 2] + rng.integers(3, 256, 4 + 16 * (i % 4)).tolist() for i in range(8)]


def _run(tiny, extra=(), fault=""):
    group = Group(tiny, fault=fault, extra=SMALL + tuple(extra))
    try:
        tokens = token_ids(group.submit_all(_prompts(), PARAMS))
        return tokens, group.client.stats(), group.restarts()
    finally:
        assert group.close() == 0


def test_worker_killed_while_writing_and_while_loading(tiny, tmp_path):
    expected, _, _ = _run(tiny)
    tier = ("--kv-offload-dir", str(tmp_path / "tier"))
    # killed at step 4: its writer thread has blocks of the first prompts queued or half written
    got, stats, restarts = _run(tiny, tier, fault="worker0:crash@step=4")
    assert got == expected and restarts.get("worker") == 1
    assert stats["kv_disk_stores"] > 0
    # a fresh group loads the prefixes back from disk, and its worker dies in the middle
    got, stats, restarts = _run(tiny, tier, fault="worker0:crash@step=2")
    assert got == expected and restarts.get("worker") == 1
    assert stats["kv_disk_loads"] > 0
