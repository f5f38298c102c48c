"""SIGKILL each role mid-stream: every request completes exactly as without the fault."""
from __future__ import annotations

import pytest

from tests.faults.conftest import Group, token_ids

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tp2_group(model_dir, prompt_ids):
    group = Group(model_dir, tp=2)
    reference = token_ids(group.submit_all(prompt_ids))
    assert all(len(r) == 20 for r in reference)
    yield group, reference
    assert group.close() == 0
    assert group.leftovers() == []


@pytest.mark.parametrize("role", ["worker1", "worker0", "detokenizer", "scheduler"])
def test_sigkill_mid_stream_loses_nothing(tp2_group, prompt_ids, role):
    group, reference = tp2_group
    before = group.client.stats()["generation_tokens"]
    futures = group.submit_all(prompt_ids)
    group.wait_tokens(before + 32 * 4)  # every stream is under way
    group.kill(role)
    assert token_ids(futures) == reference
    group.wait_healthy(120)
    assert group.blocks_in_use() == 0
