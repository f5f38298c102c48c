"""Tool calls and reasoning read from text: the streamed deltas, however the text is cut,
assemble to the non-streamed message; bad tools / tool_choice are 400s naming the problem."""
import json
import random

import pytest

from pagedserve.pipeline.ingress.chat_output import ChoiceShaper
from pagedserve.pipeline.ingress.errors import APIError
from pagedserve.pipeline.ingress.tools import plan_tools

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]

CASES = [
    ("hermes", None, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
                     '{"city": "Paris {\\"x\\"}", "name": "n"}}\n</tool_call>\n<tool_call>\n'
                     '{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'),
    ("hermes", None, "No tool needed: it is 4 < 5."),
    # untagged, as Qwen2.5-Coder writes calls: fenced or bare, naming one of the tools
    ("hermes", None, '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": '
                     '"Paris"\n  }\n}\n```\n```json\n{"name": "add", "arguments": {"a": 1}}\n```'),
    ("hermes", None, '{"name": "add", "arguments": {"a": 2, "b": 3}}'),
    ("hermes", None, '```json\n{"name": "delete_all", "arguments": {}}\n```'),
    ("hermes", None, '```python\nprint({"name": 1})\n```'),
    ("hermes", None, '{"names": ["add"]} is the JSON you asked for.'),
    ("hermes", "deepseek_r1", "I should call <the> tool.</think>\n\n<tool_call>\n"
                              '{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>'),
    ("llama3_json", None, '<|python_tag|>{"name": "add", "parameters": {"a": 5, "b": 6}}; '
                          '{"name": "get_weather", "parameters": {"city": "Oslo"}}'),
    ("llama3_json", None, "Plain answer."),
    (None, "qwen3", "<think>\nthinking hard\n</think>\n\nThe answer is 42."),
    (None, "qwen3", "No thinking here."),
]


def assemble(shaper: ChoiceShaper, text: str, rng: random.Random) -> dict:
    """Feed `text` in random cuts and assemble the deltas as an SDK would."""
    msg = {"content": "", "reasoning_content": "", "tool_calls": []}
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    for k, piece in enumerate(pieces):
        for delta in shaper.deltas(piece, final=k == len(pieces) - 1):
            msg["content"] += delta.get("content", "")
            msg["reasoning_content"] += delta.get("reasoning_content", "")
            for call in delta.get("tool_calls", []):
                if call["index"] == len(msg["tool_calls"]):
                    assert call["id"] and call["function"]["name"]  # id and name come first
                    msg["tool_calls"].append({"name": call["function"]["name"], "arguments": ""})
                msg["tool_calls"][call["index"]]["arguments"] += call["function"]["arguments"]
    return msg


@pytest.mark.parametrize("parser, reasoning, text", CASES)
def test_streamed_deltas_assemble_to_the_message(parser, reasoning, text):
    plan = plan_tools(TOOLS, "auto", None, parser) if parser else None
    whole = ChoiceShaper(plan, reasoning).message(text)
    calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
             for c in whole.get("tool_calls", [])]
    for seed in range(20):
        got = assemble(ChoiceShaper(plan, reasoning), text, random.Random(seed))
        assert got["tool_calls"] == calls
        assert got["content"] == (whole["content"] or "")
        assert got["reasoning_content"] == (whole.get("reasoning_content") or "")
    for call in calls:
        json.loads(call["arguments"])


def test_what_the_parsers_read():
    hermes = ChoiceShaper(plan_tools(TOOLS, "auto", None, "hermes"), None).message(CASES[0][2])
    assert hermes["content"] == "Let me check.\n"
    assert [json.loads(c["function"]["arguments"]) for c in hermes["tool_calls"]] == [
        {"city": 'Paris {"x"}', "name": "n"}, {"a": 1, "b": 2}]
    fenced = ChoiceShaper(plan_tools(TOOLS, "auto", None, "hermes"), None).message(CASES[2][2])
    assert fenced["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in fenced["tool_calls"]] == [("get_weather", {"city": "Paris"}), ("add", {"a": 1})]
    for text in (CASES[4][2], CASES[5][2], CASES[6][2]):  # not a call to one of the tools
        plain = ChoiceShaper(plan_tools(TOOLS, "auto", None, "hermes"), None).message(text)
        assert plain == {"role": "assistant", "content": text}
    think = ChoiceShaper(None, "qwen3").message(CASES[10][2])
    assert (think["reasoning_content"], think["content"]) == ("\nthinking hard\n", "The answer is 42.")
    r1 = ChoiceShaper(None, "deepseek_r1").message("still thinking")
    assert (r1["reasoning_content"], r1["content"]) == ("still thinking", "")


def test_required_and_named_are_constraints():
    required = plan_tools(TOOLS, "required", False, None)
    schema = json.loads(required.constraint.json)
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "add"}}, None, None)
    assert json.loads(named.constraint.json) == TOOLS[1]["function"]["parameters"]
    msg = ChoiceShaper(named, None).message('{"a": 1, "b": 2}')
    assert msg["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}


@pytest.mark.parametrize("tools, choice, parser, words", [
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "hermes", "'nope', which is not among"),
    (TOOLS, "auto", None, "start the server with --tool-call-parser"),
    (TOOLS, "sometimes", "hermes", "tool_choice must be"),
    ([{"type": "function", "function": {"name": ""}}], "required", None, "name must be a non-empty"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
     "required", None, "invalid JSON schema"),
    (None, "required", None, "tool_choice needs tools"),
])
def test_bad_tools_are_400s_naming_the_problem(tools, choice, parser, words):
    with pytest.raises(APIError) as err:
        plan_tools(tools, choice, None, parser)
    assert err.value.status == 400 and words in err.value.message


def test_tools_on_a_template_without_tool_support_are_a_400():
    from pagedserve.pipeline.ingress.chat import render_chat
    from pagedserve.pipeline.ingress.protocol import ChatCompletionRequest
    from pagedserve.pipeline.ingress.testing import make_tiny_tokenizer
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=TOOLS)
    with pytest.raises(APIError) as err:
        render_chat(make_tiny_tokenizer(), req, TOOLS)
    assert err.value.status == 400 and "does not render tools" in err.value.message
    assert render_chat(make_tiny_tokenizer(), req)  # without tools it renders


def test_an_assistant_calls_arguments_reach_the_template_as_an_object():
    """OpenAI clients send a call's arguments back as a JSON string; templates write `arguments |
    tojson`, so they are parsed into an object first (as vLLM and llama.cpp do) and the call is
    rendered once-encoded, exactly as transformers renders the same call given an object."""
    import copy
    from pathlib import Path

    from pagedserve.pipeline.ingress.chat import render_chat
    from pagedserve.pipeline.ingress.protocol import ChatCompletionRequest
    from pagedserve.pipeline.ingress.testing import make_tiny_tokenizer
    tok = copy.deepcopy(make_tiny_tokenizer())
    tok.chat_template = Path(__file__).with_name("hermes_template.jinja").read_text()
    args = '{\n  "city": "Paris"\n}'   # as Qwen2.5-Coder writes them
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "c1", "type": "function",
                    "function": {"name": "get_weather", "arguments": args}}]},
                {"role": "tool", "tool_call_id": "c1", "content": '{"temperature_c": 18}'}]
    text = tok.decode(render_chat(tok, ChatCompletionRequest(messages=messages, tools=TOOLS), TOOLS))
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
            in text) and '<tool_response>\n{"temperature_c": 18}\n</tool_response>' in text
    messages[1] = {**messages[1], "content": "", "tool_calls": [{
        "id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert text == tok.apply_chat_template(messages, tools=TOOLS, tokenize=False,
                                           add_generation_prompt=True)
    messages[1]["tool_calls"][0]["function"]["arguments"] = "{city: Paris"
    with pytest.raises(APIError) as err:
        render_chat(tok, ChatCompletionRequest(messages=messages, tools=TOOLS), TOOLS)
    assert err.value.status == 400 and "arguments are not JSON" in err.value.message
