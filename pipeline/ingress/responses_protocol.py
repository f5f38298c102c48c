"""Request bodies of OpenAI's Responses API (`POST /v1/responses`) and their translation into a
chat request (protocol.ChatCompletionRequest), which chat.prepare_chat then checks, renders with
the chat template and tokenizes as /v1/chat/completions does.

`input` is a string or a list of items read by their `type`: `message` (the default when an item
has a `role` and no type), `function_call` (the assistant's earlier call) and
`function_call_output` (its result). Image and file content is parsed only to be refused with a
400 that says why (the served models read text). A conversation continued by
`previous_response_id` is that response's items (responses_store.py) followed by `input`.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedserve.pipeline.ingress.errors import APIError, invalid
from pagedserve.pipeline.ingress.limits import MAX_CHAT_MESSAGES, MAX_TOOLS
from pagedserve.pipeline.ingress.protocol import (INT64_SCHEMA, LIMIT_KEY, ChatCompletionRequest,
                                                  documented)
from pagedserve.pipeline.ingress.validation import parse_request


class RequestBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class ContentPart(RequestBody):
    type: Literal["input_text", "output_text", "input_image", "input_file", "refusal"]
    text: str | None = None
    refusal: str | None = None


class MessageItem(RequestBody):
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]


class FunctionCallItem(RequestBody):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(RequestBody):
    type: Literal["function_call_output"]
    call_id: str
    output: str


_ITEMS = {"message": MessageItem, "function_call": FunctionCallItem,
          "function_call_output": FunctionCallOutputItem}


class FunctionTool(RequestBody):
    type: str = Field(description="function (the only tool type served)")
    name: documented(str, type="string", minLength=1) | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextConfig(RequestBody):
    format: dict[str, Any] | None = Field(
        None, description="{type: text | json_object | json_schema}; json_schema: "
                          "{name, schema, strict}")


class ResponsesRequest(RequestBody):
    """OpenAI's Responses API request (stateless core; `priority` is vLLM's extra)."""

    model: str
    input: str | list[dict[str, Any]] = Field(
        description=f"a user message, or at most {MAX_CHAT_MESSAGES} items: message, "
                    "function_call, function_call_output")
    instructions: str | None = None
    max_output_tokens: documented(int, type="integer", minimum=1,
                                  **{LIMIT_KEY: "max_tokens"}) | None = None
    temperature: documented(float, type="number", minimum=0, maximum=2) | None = None
    top_p: documented(float, type="number", exclusiveMinimum=0, maximum=1) | None = None
    stream: bool | None = False
    tools: list[FunctionTool] | None = Field(None, json_schema_extra={"maxItems": MAX_TOOLS})
    tool_choice: str | dict[str, Any] | None = Field(
        None, description="auto | none | required | {type: function, name}")
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    previous_response_id: str | None = Field(
        None, description="continue a response this replica keeps (the last few hundred)")
    store: bool | None = Field(None, description="accepted; responses are kept in memory")
    metadata: dict[str, Any] | None = Field(None, description="accepted and ignored")
    user: str | None = Field(None, description="accepted and ignored")
    priority: documented(int, **INT64_SCHEMA) | None = None


def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """`input` as a list of items (a string is one user message), each checked."""
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": req.input}]
    if len(req.input) > MAX_CHAT_MESSAGES:
        raise invalid(f"input has {len(req.input)} items, more than {MAX_CHAT_MESSAGES}", "input")
    items = []
    for i, item in enumerate(req.input):
        kind = item.get("type", "message")
        if kind not in _ITEMS:
            raise invalid(f"input items of type {kind!r} are not supported: message, "
                          "function_call and function_call_output are", f"input.{i}.type")
        try:
            parsed = parse_request(_ITEMS[kind], item)
        except APIError as exc:  # its param is the item's field: name the item too
            raise invalid(f"input.{i}: {exc.message}",
                          f"input.{i}.{exc.param}" if exc.param else f"input.{i}") from None
        items.append({**parsed.model_dump(exclude_none=True), "type": kind})
    return items


def to_chat_request(req: ResponsesRequest, items: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The conversation `items` (earlier ones first) as a chat request: instructions as the
    system message, function calls as the assistant's tool_calls, their outputs as tool
    messages, tools, tool_choice and text.format in the chat API's terms."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    for i, item in enumerate(items):
        _append_item(messages, item, f"input.{i}")
    chat: dict[str, Any] = {
        "model": req.model, "messages": messages, "max_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "stream": req.stream,
        "priority": req.priority, "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": _response_format(req.text)}
    if req.tools:
        chat["tools"] = [_chat_tool(t, f"tools.{i}") for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(req.tool_choice)
    return parse_request(ChatCompletionRequest, {k: v for k, v in chat.items() if v is not None})


def _append_item(messages: list[dict[str, Any]], item: dict[str, Any], param: str) -> None:
    if item["type"] == "message":
        role = "system" if item["role"] == "developer" else item["role"]
        messages.append({"role": role, "content": _text(item["content"], param)})
    elif item["type"] == "function_call":
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":  # calls of one turn: one message
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    else:
        messages.append({"role": "tool", "tool_call_id": item["call_id"],
                         "content": item["output"]})


def _text(content: str | list[dict[str, Any]], param: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part["type"] in ("input_image", "input_file"):
            raise invalid(f"{part['type']} content is not supported: the served model reads "
                          "text only", f"{param}.content.{j}")
        texts.append(part.get("text") or part.get("refusal") or "")
    return "\n".join(texts)


def _chat_tool(tool: FunctionTool, param: str) -> dict[str, Any]:
    if tool.type != "function":
        raise invalid(f"tools of type {tool.type!r} are not supported: only function tools are "
                      "(this server runs no built-in tools)", f"{param}.type")
    if not tool.name:
        raise invalid("a function tool needs its name", f"{param}.name")
    function: dict[str, Any] = {"name": tool.name, "description": tool.description or "",
                                "parameters": tool.parameters or {"type": "object",
                                                                  "properties": {}}}
    return {"type": "function", "function": function}


def _tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice  # auto | none | required: the chat path checks the value
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise invalid("tool_choice must be auto, none, required or {\"type\": \"function\", "
                      "\"name\": ...}", "tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(text: TextConfig | None) -> dict[str, Any] | None:
    fmt = text.format if text is not None else None
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise invalid("text.format of type json_schema needs its schema (an object)",
                          "text.format.schema")
        schema = {"name": fmt.get("name") or "response", "schema": fmt["schema"]}
        if fmt.get("strict") is not None:
            schema["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": schema}
    raise invalid(f"text.format type {fmt.get('type')!r} is not supported: text, json_object "
                  "or json_schema", "text.format.type")
