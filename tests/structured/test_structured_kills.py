"""SIGKILL a worker, the scheduler and the detokenizer mid-stream during 32 JSON-schema streams:
every output is valid JSON of its schema and identical to the clean greedy run (the matchers
are rebuilt from the token history the scheduler keeps, or the clients resubmit). The group
serves the tiny random chat model (conftest.py), whose steps take milliseconds."""
from __future__ import annotations

import json

import jsonschema
import pytest

from pagedserve.pipeline import SamplingParams
from pagedserve.pipeline.structured.spec import StructuredOutputs
from faults.conftest import Group, token_ids

pytestmark = pytest.mark.slow

SCHEMAS = [
    {"type": "object", "properties": {"topic": {"type": "string", "pattern": "^[a-z ]{40,60}$"},
                                      "rating": {"type": "integer", "minimum": 1, "maximum": 5},
                                      "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                               "maxItems": 3}},
     "required": ["topic", "rating", "tags"]},
    {"type": "object", "properties": {"summary": {"type": "string", "pattern": "^[a-z ,.]{40,80}$"},
                                      "positive": {"type": "boolean"}},
     "required": ["summary", "positive"]},
]


def params(i: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=300, structured_outputs=
                          StructuredOutputs.from_json_schema(SCHEMAS[i % 2]))


@pytest.fixture(scope="module")
def prompt_ids():
    """32 prompts of the byte-level tokenizer (a token per byte)."""
    return [list(f"Review number {i}: ".encode()) for i in range(32)]


@pytest.fixture(scope="module")
def group_and_reference(tiny_chat_dir, prompt_ids):
    group = Group(tiny_chat_dir)
    futures = group.submit_all(prompt_ids, params)
    reference = token_ids(futures)
    for i, f in enumerate(futures):
        out = f.result().outputs[0]
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), SCHEMAS[i % 2])
    yield group, reference, [f.result().outputs[0].text for f in futures]
    assert group.close() == 0
    assert group.leftovers() == []


@pytest.mark.parametrize("role", ["worker0", "detokenizer", "scheduler"])
def test_kill_mid_json_stream_gives_the_clean_output(group_and_reference, prompt_ids, role):
    group, reference, texts = group_and_reference
    counted = "worker" if role.startswith("worker") else role
    restarts_before = group.restarts().get(counted, 0)
    before = group.client.stats()["generation_tokens"]
    futures = group.submit_all(prompt_ids, params)
    group.wait_tokens(before + 32 * 4)  # every stream is under way
    killed = group.kill(role)
    assert not all(f.done() for f in futures)  # the kill hit streams in flight
    assert token_ids(futures) == reference
    assert [f.result().outputs[0].text for f in futures] == texts
    assert group.wait_restarted(role, killed) != killed
    restarts = group.restarts()
    assert restarts.get(counted, 0) == (1 if role == "scheduler" else restarts_before + 1)
    assert group.blocks_in_use() == 0
