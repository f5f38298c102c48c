"""Issue 38: a streamed chat choice with tool calls or reasoning costs work linear in its
length. The ingress used to read the whole text again per delta (quadratic: 20,000 characters
in 3-character deltas took 22 s of event-loop time); it now scans each delta once
(pipeline/ingress/tool_stream.py, reasoning.ReasoningStream). Work is counted, not timed:
characters handed to the scanners, and Python lines run. The one-pass readers send exactly
what the whole-text readers (tools.ToolCallStream re-parsing per delta) send."""
from __future__ import annotations

import json
import random
import sys

import pytest

from pagedserve.pipeline.ingress import reasoning, tool_stream, tools
from pagedserve.pipeline.ingress.chat_output import ChoiceShaper
from pagedserve.pipeline.ingress.marker_scan import MarkerScan
from pagedserve.pipeline.ingress.tool_scan import CallScan, Opening

TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
         for name in ("add", "get_weather")]
HERMES = tools.plan_tools(TOOLS, "auto", None, "hermes")
LLAMA3 = tools.plan_tools(TOOLS, "auto", None, "llama3_json")
REQUIRED = tools.plan_tools(TOOLS, "required", None, None)
NAMED = tools.plan_tools(TOOLS, {"type": "function", "function": {"name": "add"}}, None, None)


def long_outputs(n: int) -> dict[str, tuple]:
    """Outputs of about n characters: (tool plan, reasoning parser, text)."""
    code = json.dumps({"name": "add", "arguments": {"code": 'x = {"a": [1, "}"]}\n' * (n // 22)}})
    calls = [json.dumps({"name": "add", "arguments": {"a": i}}) for i in range(n // 38)]
    return {
        "hermes, one long call": (HERMES, None, f"Sure.\n<tool_call>\n{code}\n</tool_call>"),
        "hermes, many tagged": (HERMES, None, "".join(f"<tool_call>{c}</tool_call>\n" for c in calls)),
        "hermes, untagged fenced": (HERMES, None, "".join(f"```json\n{c}\n```\n" for c in calls)),
        "hermes, content": (HERMES, None, "no call here, a < b and <tool is text. " * (n // 40)),
        "llama3": (LLAMA3, None, "<|python_tag|>" + "; ".join(c.replace("arguments", "parameters")
                                                             for c in calls)),
        "required": (REQUIRED, None, "[" + ", ".join(calls) + "]"),
        "named": (NAMED, None, code),
        "thinking, then a call": (HERMES, "deepseek_r1",
                                  "hmm, </thin " * (n // 24) + f"</think>\n<tool_call>{code[:n // 2]}"),
        "qwen3 thinking only": (None, "qwen3", "<think>" + "a thought " * (n // 10)),
    }


def stream(shaper: ChoiceShaper, text: str, step: int = 2) -> list[dict]:
    out = []
    for i in range(0, len(text), step):
        out += shaper.deltas(text[i:i + step], final=i + step >= len(text))
    return out


def counting(monkeypatch) -> list[int]:
    """Count the characters every scan and every whole-text read is handed."""
    total = [0]

    def wrap(owner, name, size):
        inner = getattr(owner, name)

        def counted(*args, **kwargs):
            total[0] += size(*args, **kwargs)
            return inner(*args, **kwargs)
        monkeypatch.setattr(owner, name, counted)

    rest = lambda piece, i=0: len(piece) - i  # noqa: E731
    wrap(CallScan, "feed", lambda self, *a: rest(*a))
    wrap(MarkerScan, "feed", lambda self, *a: len(self.held) + rest(*a))
    wrap(Opening, "feed", lambda self, *a: rest(*a))
    wrap(tool_stream.ToolDeltaStream, "_text", lambda self: sum(map(len, self._chunks)))
    wrap(tools.ToolPlan, "parse", lambda self, text, final: len(text))
    wrap(reasoning, "split", lambda parser, text, final: len(text))
    return total


@pytest.mark.parametrize("case", list(long_outputs(1)))
def test_characters_scanned_are_linear_in_the_output(monkeypatch, case):
    plan, parser, text = long_outputs(60_000)[case]
    total = counting(monkeypatch)
    deltas = stream(ChoiceShaper(plan, parser), text)
    assert deltas and len(text) > 50_000
    assert total[0] <= 6 * len(text), f"{total[0]} characters scanned for {len(text)}"


def python_lines(fn) -> int:
    lines = [0]

    def local(frame, event, arg):
        lines[0] += event == "line"
        return local
    sys.settrace(lambda frame, event, arg: local)
    try:
        fn()
    finally:
        sys.settrace(None)
    return lines[0]


@pytest.mark.parametrize("case", ["hermes, one long call", "hermes, untagged fenced", "required",
                                  "thinking, then a call"])
def test_python_steps_grow_linearly_with_the_output(case):
    """4x the output, in the same deltas, runs at most ~4x the Python lines."""
    small, large = (long_outputs(n)[case] for n in (2_000, 8_000))
    steps = [python_lines(lambda o=o: stream(ChoiceShaper(o[0], o[1]), o[2])) for o in (small, large)]
    growth = (steps[1] / steps[0]) / (len(large[2]) / len(small[2]))
    assert growth < 1.2, f"{steps} lines for {len(small[2])} and {len(large[2])} characters"


def test_the_re_parsing_stream_fails_the_same_measure():
    """The measure has teeth: the per-delta re-parse grows with the square of the output."""
    def old(text):
        feed = tools.ToolCallStream(HERMES).feed
        return lambda: [feed(text[i:i + 2], i + 2 >= len(text)) for i in range(0, len(text), 2)]
    small, large = (long_outputs(n)["hermes, one long call"][2] for n in (250, 1_000))
    steps = [python_lines(old(t)) for t in (small, large)]
    assert (steps[1] / steps[0]) / (len(large) / len(small)) > 2.5


# -- the one-pass readers send what the whole-text readers send --------------------------------
PIECES = ['a', ' ', '"', '\\', '{', '}', '[', ']', '<tool_call>', '</tool_call>', '</tool', '\n',
          'é', ',', ':', '\\u00e9', 'name', '```']


def _string(rng):
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 6)))


def _value(rng, depth=0):
    r = rng.random()
    if depth > 2 or r < 0.3:
        return _string(rng)
    if r < 0.45:
        return rng.choice([1, -2.5, True, None])
    if r < 0.7:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {_string(rng): _value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def _call(rng, args_key):
    items = [("name", rng.choice(["add", "get_weather", "zzz", 5]))] if rng.random() < 0.9 else []
    items.append((args_key, _value(rng)))
    if rng.random() < 0.2:  # a repeated key, or both argument keys
        items.append((rng.choice(["name", "arguments", "parameters"]), _value(rng)))
    if rng.random() < 0.3:
        rng.shuffle(items)
    sep = rng.choice(["", " ", "\n  "])
    return "{" + sep + f",{sep}".join(f"{json.dumps(k)}: {json.dumps(v, ensure_ascii=rng.random() < .5)}"
                                       for k, v in items) + sep + "}"


def _output(rng, plan):
    if plan is NAMED:
        text = json.dumps(_value(rng))
    elif plan is REQUIRED:
        text = rng.choice(["", "\n"]) + "[" + ", ".join(_call(rng, "arguments")
                                                         for _ in range(rng.randint(0, 3))) + "]"
    elif plan is LLAMA3:
        text = rng.choice(["", "<|python_tag|>", " ", "Sure: "]) + "; ".join(
            _call(rng, "parameters") for _ in range(rng.randint(0, 3)))
    elif rng.random() < 0.5:
        text = rng.choice(["", "Let me check.\n"]) + "".join(
            f"<tool_call>{rng.choice(['', chr(10)])}{_call(rng, 'arguments')}\n</tool_call>"
            f"{rng.choice(['', chr(10), 'x'])}" for _ in range(rng.randint(0, 3)))
    else:
        text = rng.choice(["", " "]) + "".join(
            (f"```json\n{_call(rng, 'arguments')}\n```\n" if rng.random() < 0.5
             else _call(rng, "arguments") + rng.choice(["\n", ""])) for _ in range(rng.randint(1, 3)))
    for _ in range(rng.choice([0, 0, 1, 2])):  # damage: a character dropped, a tag added, cut
        if text:
            i, op = rng.randrange(len(text)), rng.random()
            text = (text[:i] + text[i + 1:] if op < 0.33 else
                    text[:i] + rng.choice(PIECES + ["<|python_tag|>", '"name"']) + text[i:]
                    if op < 0.66 else text[:i])
    return text


def _cut(rng, text):
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])] or [""]


@pytest.mark.parametrize("plan", [HERMES, LLAMA3, REQUIRED, NAMED], ids=lambda p: p.parser or p.mode)
def test_one_pass_deltas_are_the_whole_text_readers_deltas(plan):
    for seed in range(1500):
        rng = random.Random(seed)
        pieces = _cut(rng, _output(rng, plan))
        ours, theirs = tool_stream.ToolDeltaStream(plan, lambda: "call_x"), tools.ToolCallStream(plan)
        for k, piece in enumerate(pieces):
            final = k == len(pieces) - 1
            expected = theirs.feed(piece, final)
            for delta in expected:
                for call in delta.get("tool_calls", []):
                    call.update({"id": "call_x"} if "id" in call else {})
            assert ours.feed(piece, final) == expected, (seed, pieces, k)


@pytest.mark.parametrize("parser", reasoning.PARSERS)
def test_reasoning_deltas_are_the_whole_text_readings(parser):
    atoms = ["<think>", "</think>", "<th", "ink>", "</th", " ", "\n", "a", "<", "/", "</think"]
    for seed in range(3000):
        rng = random.Random(seed)
        pieces = _cut(rng, "".join(rng.choice(atoms) for _ in range(rng.randint(0, 12))))
        got, sent = reasoning.ReasoningStream(parser), ["", ""]
        for k, piece in enumerate(pieces):
            final = k == len(pieces) - 1
            new = got.feed(piece, final)
            sent = [sent[0] + new[0], sent[1] + new[1]]
            assert tuple(sent) == reasoning.split(parser, "".join(pieces[:k + 1]), final), \
                (seed, pieces, k)
