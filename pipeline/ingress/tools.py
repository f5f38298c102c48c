"""OpenAI tool calling on /v1/chat/completions: what a request's `tools` and `tool_choice` mean
for the prompt, the constraint and the response.

- `none`: the output is content.
- `auto` (the default with tools): the output is read with the server's --tool-call-parser,
  or without the flag the parser the chat template calls for (`resolve_tool_parser`).
- `required` and a named function are enforced by the grammar, not hoped for: the output is
  constrained to a JSON array of {"name", "arguments"} objects (one of the tools each; one
  item when parallel_tool_calls is false), or to the named function's parameters schema.

`ToolCallStream` turns the growing text of one choice into OpenAI `tool_calls` deltas: a call's
id, type and name first, then fragments of its arguments' raw text, so the deltas assemble to
exactly the non-streamed message (`message`), which reads the final text the same way.
"""
from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from pagedserve.pipeline.ingress.errors import invalid
from pagedserve.pipeline.ingress.limits import MAX_TOOLS, MAX_TOOLS_JSON_CHARS
from pagedserve.pipeline.ingress.tool_parsers import (PARSERS, Parsed, ParsedCall,
                                                      parse_json_array, parser_for_template)
from pagedserve.pipeline.structured.spec import StructuredOutputs

log = logging.getLogger("pagedserve.ingress")


@dataclass(frozen=True)
class ToolPlan:
    """How one request's output is read: `mode` none | auto | required | named."""

    mode: str
    tools: list[dict]            # the request's tools, as the chat template takes them
    parser: str | None = None    # auto: the --tool-call-parser
    function: str | None = None  # named: the function's name
    constraint: StructuredOutputs | None = None

    @cached_property  # parse runs per streamed delta: the names are built once
    def names(self) -> frozenset[str]:
        return frozenset(t["function"]["name"] for t in self.tools)

    def parse(self, text: str, final: bool) -> Parsed:
        if self.mode == "auto":
            return PARSERS[self.parser](text, final, self.names)
        if self.mode == "required":
            return parse_json_array(text, final)
        if self.mode == "named":  # the whole output is the arguments object
            return Parsed("", [ParsedCall(self.function, text, final)])
        return Parsed(text)


def resolve_tool_parser(flag: str | None, chat_template: str | None) -> str | None:
    """--tool-call-parser when given, else the parser the chat template's format calls for
    (tool_parsers.parser_for_template); logged once at start, so `tool_choice: auto` works on
    a tool-aware model without the flag."""
    if flag is not None:
        log.info("tool calls: the %s parser (--tool-call-parser)", flag)
        return flag
    chosen = parser_for_template(chat_template)
    if chosen is not None:
        log.info("tool calls: the %s parser, chosen from the chat template "
                 "(--tool-call-parser overrides)", chosen)
    elif chat_template and "tools" in chat_template:
        log.info("tool calls: the chat template renders tools in a format no parser here reads; "
                 "tool_choice auto needs --tool-call-parser")
    return chosen


def _check_tools(tools: list[dict]) -> dict[str, dict]:
    if len(tools) > MAX_TOOLS:
        raise invalid(f"tools has {len(tools)} functions but at most {MAX_TOOLS} are allowed",
                      "tools")
    size = len(json.dumps(tools, separators=(",", ":"), ensure_ascii=False))
    if size > MAX_TOOLS_JSON_CHARS:
        raise invalid(f"tools has {size} characters as JSON but at most {MAX_TOOLS_JSON_CHARS} "
                      "are allowed", "tools")
    by_name = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise invalid(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}",
                          "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise invalid(f"tools[{i}].function.name must be a non-empty string", "tools")
        if name in by_name:
            raise invalid(f"tools has two functions named {name!r}", "tools")
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise invalid(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        by_name[name] = params
    return by_name


def plan_tools(tools: list[dict] | None, tool_choice: Any, parallel: bool | None,
               parser: str | None) -> ToolPlan | None:
    """The request's ToolPlan (None without tools); a 400 naming the problem otherwise."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise invalid("tool_choice needs tools", "tool_choice")
        return None
    schemas = _check_tools(tools)
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolPlan("none", tools)
    if choice == "auto":
        if parser is None:
            raise invalid("tool_choice auto needs a tool-call parser: none fits this model's "
                          "chat template, so start the server with --tool-call-parser (hermes "
                          "or llama3_json), or use tool_choice required or a named function, "
                          "which the grammar enforces", "tool_choice")
        return ToolPlan("auto", tools, parser=parser)
    if choice == "required":
        items = [{"type": "object", "properties": {"name": {"const": name}, "arguments": params},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for name, params in schemas.items()]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if parallel is False:
            schema["maxItems"] = 1
        return ToolPlan("required", tools, constraint=_schema(schema))
    if isinstance(choice, dict) and choice.get("type") == "function" \
            and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in schemas:
            raise invalid(f"tool_choice names function {name!r}, which is not among the tools "
                          f"({', '.join(schemas)})", "tool_choice")
        return ToolPlan("named", tools, function=name, constraint=_schema(schemas[name]))
    raise invalid("tool_choice must be none, auto, required or {\"type\": \"function\", "
                  "\"function\": {\"name\": ...}}", "tool_choice")


def _schema(schema: dict) -> StructuredOutputs:
    try:
        return StructuredOutputs.from_json_schema(schema).check()
    except ValueError as exc:
        raise invalid(f"tools: {exc}", "tools") from None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def message(plan: ToolPlan, text: str) -> dict[str, Any]:
    """The non-streamed assistant message of a choice's whole text."""
    parsed = plan.parse(text, final=True)
    calls = [c for c in parsed.calls if c.name is not None]
    if not calls:
        return {"role": "assistant", "content": parsed.content}
    return {"role": "assistant", "content": parsed.content or None,
            "tool_calls": [{"id": new_call_id(), "type": "function",
                            "function": {"name": c.name, "arguments": c.arguments}}
                           for c in calls]}


def has_calls(plan: ToolPlan, text: str) -> bool:
    return any(c.name is not None for c in plan.parse(text, final=True).calls)


class ToolCallStream:
    """One choice's deltas: content, then each call's header and argument fragments."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.content_sent = 0
        self.ids: list[str] = []         # one per call whose header went out
        self.args_sent: list[int] = []

    def feed(self, text: str, final: bool = False) -> list[dict[str, Any]]:
        """Deltas ({"content": ...} or {"tool_calls": [...]}) for `text` appended."""
        self.text += text
        parsed = self.plan.parse(self.text, final)
        out = []
        if len(parsed.content) > self.content_sent:
            out.append({"content": parsed.content[self.content_sent:]})
            self.content_sent = len(parsed.content)
        named = [c for c in parsed.calls if c.name is not None]
        for index, call in enumerate(named):
            if index == len(self.ids):  # a new call: its header first
                self.ids.append(new_call_id())
                self.args_sent.append(0)
                out.append({"tool_calls": [{"index": index, "id": self.ids[index],
                                            "type": "function",
                                            "function": {"name": call.name, "arguments": ""}}]})
            fragment = call.arguments[self.args_sent[index]:]
            if fragment:
                self.args_sent[index] = len(call.arguments)
                out.append({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]})
        return out

    @property
    def called(self) -> bool:
        return bool(self.ids)


def template_messages_args(msg: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's tool_calls as chat templates take them: arguments as an object
    (a template writes `arguments | tojson`; a string would be encoded twice)."""
    calls = []
    for call in msg.get("tool_calls") or []:
        fn = dict(call.get("function") or {})
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                fn["arguments"] = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise invalid(f"an assistant tool call's arguments are not JSON: {args[:60]!r}",
                              "messages") from None
        calls.append({**call, "function": fn})
    return {**msg, "tool_calls": calls}
