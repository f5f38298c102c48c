"""N-gram speculation and overlapped scheduling on the real model (SmolLM2, launched groups):
greedy outputs equal those of a group with neither (`--no-async-scheduling`, no drafts), under
preemption, an abort and a worker killed mid-stream. Equality holds bit for bit because every
kernel's row result is independent of the batch (a draft row computes as the decode of that
token would), and a step planned ahead computes what the step planned after the result would."""
from __future__ import annotations

import json

import pytest

from pagedserve.pipeline import SamplingParams
from pagedserve.pipeline.tokenizer import load_tokenizer
from faults.conftest import Group, token_ids

pytestmark = pytest.mark.slow

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                   "prompt_lookup_min": 1})
# A small pool (recompute and swap under 8 streams) and prompts whose answers repeat them
POOL = ("--kv-cache-memory", "12MiB", "--max-num-seqs", "8")
ITEMS = ["apples", "rivers", "copper", "violins", "tigers", "maps", "salt", "lanterns"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=48)


def _prompts(model_dir) -> list[list[int]]:
    tok = load_tokenizer(model_dir)
    out = []
    for i in range(8):
        words = ", ".join(ITEMS[i:] + ITEMS[:i])
        text = f"Copy this list twice, exactly as written: {words}."
        chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                       add_generation_prompt=True)
        out.append(tok.encode(chat, add_special_tokens=False))
    return out


@pytest.fixture(scope="module")
def prompts(model_dir):
    return _prompts(model_dir)


@pytest.fixture(scope="module")
def reference(model_dir, prompts):
    plain = Group(model_dir, extra=POOL + ("--no-async-scheduling",))
    try:
        out = token_ids(plain.submit_all(prompts, GREEDY))
        stats = plain.client.stats()
        assert "spec_decode_num_drafts" not in stats and stats["steps_planned_ahead"] == 0
        return out
    finally:
        assert plain.close() == 0


def _abort_and_kill_mid_stream(group, prompts, reference, before: int) -> None:
    """Again, one request aborted and worker0 killed while the others stream: the others'
    outputs are the reference's, and nothing is left behind."""
    futures = [group.client.submit(ids, GREEDY, request_id=f"s{i}")
               for i, ids in enumerate(prompts)]
    group.wait_tokens(before + 8 * 6)
    group.client.abort("s3")
    killed = group.kill("worker0")
    assert not all(f.done() for f in futures)  # the kill hit streams in flight
    kept = [i for i in range(len(prompts)) if i != 3]
    assert token_ids([futures[i] for i in kept]) == [reference[i] for i in kept]
    assert group.wait_restarted("worker0", killed) != killed
    assert group.restarts()["worker"] == 1
    assert group.blocks_in_use() == 0


def test_drafts_leave_greedy_outputs_unchanged_under_preemption_abort_and_a_worker_kill(
        model_dir, prompts, reference):
    group = Group(model_dir, extra=POOL + ("--speculative-config", SPEC))
    try:
        assert token_ids(group.submit_all(prompts, GREEDY)) == reference
        stats = group.client.stats()
        assert stats["num_preemptions"] > 0  # the pool was short: sequences were pushed out
        assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
        assert stats["spec_decode_request_acceptance"]["count"] == len(prompts)
        _abort_and_kill_mid_stream(group, prompts, reference, stats["generation_tokens"])
    finally:
        assert group.close() == 0
    assert group.leftovers() == []


def test_steps_planned_ahead_leave_greedy_outputs_unchanged_under_preemption_abort_and_a_kill(
        model_dir, prompts, reference):
    group = Group(model_dir, extra=POOL)  # --async-scheduling is the default
    try:
        assert token_ids(group.submit_all(prompts, GREEDY)) == reference
        stats = group.client.stats()
        assert stats["num_preemptions"] > 0
        assert stats["steps_planned_ahead"] > 0  # steps overlapped the ones before them
        _abort_and_kill_mid_stream(group, prompts, reference, stats["generation_tokens"])
        assert group.client.stats()["steps_planned_ahead"] > stats["steps_planned_ahead"]
    finally:
        assert group.close() == 0
    assert group.leftovers() == []
