"""Fields that multiply work (issue 38): each over its named limit is a 400 naming the field, the
value and the limit, at the gate every entry point passes; at the limit it is accepted."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from pagedserve.pipeline.ingress import build_app, limits
from pagedserve.pipeline.ingress.testing import make_test_context
from pagedserve.pipeline.ingress.tools import plan_tools
from pagedserve.pipeline.sampling_params import (MAX_LOGIT_BIAS_ENTRIES, MAX_STOP_STRING_CHARS,
                                                 MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS,
                                                 SamplingParams)
from pagedserve.pipeline.structured.spec import (MAX_CHOICES, MAX_SPEC_CHARS, MAX_SPEC_DEPTH,
                                                 StructuredOutputs)

CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]
GOOD = {COMPL: {"prompt": "Hello", "max_tokens": 3}, CHAT: {"messages": MSGS, "max_tokens": 3}}


def _tool(i: int, description: str = "") -> dict:
    return {"type": "function", "function": {"name": f"f{i}", "description": description,
                                             "parameters": {"type": "object"}}}


def _nested_schema(levels: int) -> str:
    return '{"type":"array","items":' * levels + "{}" + "}" * levels


# (name, path, extra fields, param, the whole message)
REFUSED = [
    ("too many stop strings", CHAT, {"stop": [f"s{i}" for i in range(17)]}, "stop",
     "stop has 17 strings but at most 16 are allowed"),
    ("the 300,000-character stop string", CHAT, {"stop": "x" * 300_000}, "stop",
     "stop[0] has 300000 characters but at most 1024 are allowed"),
    ("one stop string too long", COMPL, {"stop": ["ok", "y" * 1025]}, "stop",
     "stop[1] has 1025 characters but at most 1024 are allowed"),
    ("too many stop token ids", COMPL, {"stop_token_ids": [7] * 257}, "stop_token_ids",
     "stop_token_ids has 257 token ids but at most 256 are allowed"),
    ("too many logit_bias entries", CHAT, {"logit_bias": {str(i): 1 for i in range(1025)}},
     "logit_bias", "logit_bias has 1025 entries but at most 1024 are allowed"),
    ("too many messages", CHAT, {"messages": MSGS * 2049}, "messages",
     "messages has 2049 entries but at most 2048 are allowed"),
    ("too many tools", CHAT, {"tools": [_tool(i) for i in range(129)]}, "tools",
     "tools has 129 functions but at most 128 are allowed"),
    ("tools too large", CHAT, {"tools": [_tool(0, "d" * 200_000)]}, "tools",
     f"tools has {len(json.dumps([_tool(0, 'd' * 200_000)], separators=(',', ':')))} "
     "characters as JSON but at most 200000 are allowed"),
    ("regex too large", COMPL, {"guided_regex": "a" * 200_001}, "guided_regex",
     "guided_regex: structured output regex has 200001 characters but at most 200000 are "
     "allowed"),
    ("too many choices", CHAT, {"structured_outputs": {"choice": ["c"] * 1025}},
     "structured_outputs", "structured_outputs: structured output choice has 1025 choices but "
     "at most 1024 are allowed"),
    ("schema nested too deep", CHAT, {"guided_json": _nested_schema(400)}, "guided_json",
     "guided_json: the JSON schema nests arrays and objects 401 levels deep; at most 64 levels "
     "are allowed"),
    ("schema nested past the JSON parser", COMPL, {"guided_json": "[" * 5000 + "]" * 5000},
     "guided_json", "guided_json: the JSON schema nests arrays and objects deeper than a JSON "
     "parser allows; at most 64 levels are allowed"),
    ("structural tag nested too deep", COMPL,
     {"structured_outputs": {"structural_tag": "[" * 100 + "]" * 100}}, "structured_outputs",
     "structured_outputs: structured output structural_tag nests arrays and objects 100 levels "
     "deep; at most 64 levels are allowed"),
]

AT_THE_LIMIT = [
    ("16 stop strings of 1024 characters", CHAT,
     {"stop": [chr(65 + i) * 1024 for i in range(16)]}),
    ("256 stop token ids", COMPL, {"stop_token_ids": list(range(256))}),
    ("1024 logit_bias entries", COMPL, {"logit_bias": {str(i % 250): 0 for i in range(1024)}}),
    ("1024 choices", CHAT, {"guided_choice": [f"c{i}" for i in range(1024)]}),
]


async def _post(client, path, body):
    return await client.post(path, content=json.dumps(body),
                             headers={"content-type": "application/json"})


async def _exchange(path, extra):
    ctx, engine = make_test_context(max_request_bytes=1 << 20, max_model_len=1 << 15)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(ctx)),
                                 base_url="http://test") as client:
        first = await _post(client, path, {**GOOD[path], **extra})
        good = await _post(client, path, GOOD[path])
    return first, good, engine


@pytest.mark.parametrize("name,path,extra,param,message", REFUSED, ids=[c[0] for c in REFUSED])
def test_over_the_limit_is_a_400_naming_field_value_and_limit(name, path, extra, param, message):
    refused, good, engine = asyncio.run(_exchange(path, extra))
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == param
    assert refused.json()["error"]["message"] == message
    assert good.status_code == 200, good.text
    assert len(engine.submitted) == 1  # only the good one reached the engine


@pytest.mark.parametrize("name,path,extra", AT_THE_LIMIT, ids=[c[0] for c in AT_THE_LIMIT])
def test_at_the_limit_is_accepted(name, path, extra):
    accepted, _, engine = asyncio.run(_exchange(path, extra))
    assert accepted.status_code == 200, accepted.text
    assert len(engine.submitted) == 2


def test_128_tools_are_planned():
    # (The test tokenizer's template renders no tools: the plan is what the limit gates.)
    plan = plan_tools([_tool(i) for i in range(128)], "required", None, None)
    assert plan.mode == "required" and len(plan.names) == 128


@pytest.mark.parametrize("kwargs,message", [
    (dict(stop=["a"] * (MAX_STOP_STRINGS + 1)), "stop has 17 strings but at most 16 are allowed"),
    (dict(stop=["z" * (MAX_STOP_STRING_CHARS + 1)]),
     "stop[0] has 1025 characters but at most 1024 are allowed"),
    (dict(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1)),
     "stop_token_ids has 257 token ids but at most 256 are allowed"),
    (dict(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}),
     "logit_bias has 1025 entries but at most 1024 are allowed"),
    (dict(n=129), "n must be between 1 and 128, got 129"),
    (dict(logprobs=21), "logprobs must be between 0 and 20, got 21"),
])
def test_the_python_api_and_engine_client_meet_the_same_gate(kwargs, message):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs).validate()
    assert str(err.value) == message


@pytest.mark.parametrize("spec,message", [
    (StructuredOutputs(grammar="g" * (MAX_SPEC_CHARS + 1)),
     "structured output grammar has 200001 characters but at most 200000 are allowed"),
    (StructuredOutputs(choice=["ab"] * (MAX_SPEC_CHARS // 2) + ["c"]),
     "structured output choice has 100001 choices but at most 1024 are allowed"),
    (StructuredOutputs(choice=["q" * 1000] * 201),
     "structured output choice has 201000 characters but at most 200000 are allowed"),
    (StructuredOutputs(json=_nested_schema(MAX_SPEC_DEPTH)),
     "structured output json nests arrays and objects 65 levels deep; at most 64 levels are "
     "allowed"),
])
def test_the_scheduler_checks_spec_sizes_without_compiling(spec, message):
    # The scheduler's admission validates with check_structured=False: sizes still count.
    with pytest.raises(ValueError) as err:
        SamplingParams(structured_outputs=spec).validate(check_structured=False)
    assert str(err.value) == message


def test_the_limits_a_normal_client_does_not_reach():
    assert (MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS, MAX_STOP_TOKEN_IDS,
            MAX_LOGIT_BIAS_ENTRIES) == (16, 1024, 256, 1024)
    assert (limits.MAX_CHAT_MESSAGES, limits.MAX_TOOLS, limits.MAX_TOOLS_JSON_CHARS) == \
        (2048, 128, 200_000)
    assert (MAX_SPEC_CHARS, MAX_CHOICES, MAX_SPEC_DEPTH) == (200_000, 1024, 64)
