"""Request bodies of Anthropic's Messages API (`POST /v1/messages`) and their translation into
a chat request (protocol.ChatCompletionRequest), which chat.prepare_chat then checks, renders
with the chat template and tokenizes as /v1/chat/completions does.

Models are strict and ignore unknown fields, as protocol.py's are. Content blocks are read by
their `type`: `text`, `tool_use` (assistant turns), `tool_result` (user turns), and `image`,
which is parsed only to be refused with a 400 that says why (the served models read text).
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedserve.pipeline.ingress.errors import invalid
from pagedserve.pipeline.ingress.limits import MAX_CHAT_MESSAGES, MAX_TOOLS
from pagedserve.pipeline.ingress.protocol import (INT64_SCHEMA, STOP_SCHEMA, LIMIT_KEY,
                                                  ChatCompletionRequest, documented)
from pagedserve.pipeline.ingress.validation import parse_request
from pagedserve.pipeline.sampling_params import INT64_MAX, MAX_STOP_STRINGS


class RequestBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextBlock(RequestBody):
    type: Literal["text"]
    text: str


class ImageBlock(RequestBody):
    type: Literal["image"]
    source: dict[str, Any]


class ToolUseBlock(RequestBody):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(RequestBody):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]] | None = None
    is_error: bool | None = None


ContentBlock = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock,
                         Field(discriminator="type")]


class InputMessage(RequestBody):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class AnthropicTool(RequestBody):
    name: documented(str, type="string", minLength=1)
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(RequestBody):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, description="type tool: the tool's name")
    disable_parallel_tool_use: bool | None = None


class MessagesRequest(RequestBody):
    """Anthropic's Messages API request; `priority` is vLLM's extra (lower runs first)."""

    model: str
    max_tokens: documented(int, type="integer", minimum=1, **{LIMIT_KEY: "max_tokens"}) = Field(
        description="input tokens + max_tokens must fit the model's context")
    messages: list[InputMessage] = Field(min_length=1, description=f"at most {MAX_CHAT_MESSAGES}")
    system: str | list[TextBlock] | None = None
    stop_sequences: documented(list[str], type="array", items=STOP_SCHEMA,
                         maxItems=MAX_STOP_STRINGS) | None = None
    temperature: documented(float, type="number", minimum=0, maximum=1) | None = None
    top_p: documented(float, type="number", exclusiveMinimum=0, maximum=1) | None = None
    top_k: documented(int, type="integer", minimum=1, maximum=INT64_MAX) | None = None
    stream: bool | None = False
    tools: list[AnthropicTool] | None = Field(None, json_schema_extra={"maxItems": MAX_TOOLS})
    tool_choice: ToolChoice | None = None
    metadata: dict[str, Any] | None = Field(None, description="accepted and ignored")
    priority: documented(int, **INT64_SCHEMA) | None = None

    def check(self) -> None:
        """What the chat request's own checks would name by another field."""
        if self.temperature is not None and not 0 <= self.temperature <= 1:
            raise invalid(f"temperature must be in [0, 1], got {self.temperature}", "temperature")
        if self.top_k is not None and self.top_k < 1:
            raise invalid(f"top_k must be at least 1, got {self.top_k}", "top_k")
        if self.tool_choice is not None and self.tool_choice.type == "tool" \
                and not self.tool_choice.name:
            raise invalid("tool_choice of type tool needs the tool's name", "tool_choice")


def to_chat_request(req: MessagesRequest, tool_call_parser: str | None) -> ChatCompletionRequest:
    """The same conversation as a chat request: system first, tool_use blocks as the assistant's
    tool_calls, tool_result blocks as tool messages, tools and tool_choice in OpenAI's terms."""
    req.check()
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": _system_text(req.system)})
    for i, message in enumerate(req.messages):
        messages.extend(_chat_messages(message, f"messages.{i}.content"))
    chat: dict[str, Any] = {
        "model": req.model, "messages": messages, "max_tokens": req.max_tokens,
        "stop": req.stop_sequences, "temperature": req.temperature, "top_p": req.top_p,
        "top_k": req.top_k, "stream": req.stream, "priority": req.priority}
    if req.tools:
        chat["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description or "", "parameters": t.input_schema}}
            for t in req.tools]
    chat.update(_tool_choice(req, tool_call_parser))
    return parse_request(ChatCompletionRequest, {k: v for k, v in chat.items() if v is not None})


def _system_text(system: str | list[TextBlock]) -> str:
    return system if isinstance(system, str) else "\n".join(b.text for b in system)


def _chat_messages(message: InputMessage, param: str) -> list[dict[str, Any]]:
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    for j, block in enumerate(message.content):
        if isinstance(block, ImageBlock) or isinstance(block, ToolResultBlock) and \
                isinstance(block.content, list) and \
                any(isinstance(b, ImageBlock) for b in block.content):
            raise invalid("image content blocks are not supported: the served model reads "
                          "text only", f"{param}.{j}")
    if message.role == "assistant":
        return [_assistant_message(message.content, param)]
    return _user_messages(message.content, param)


def _assistant_message(blocks: list, param: str) -> dict[str, Any]:
    texts, calls = [], []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input)}})
        else:
            raise invalid("a tool_result block belongs in a user message", f"{param}.{j}")
    msg: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        msg["tool_calls"] = calls
    return msg


def _user_messages(blocks: list, param: str) -> list[dict[str, Any]]:
    """Tool results become tool messages and runs of text blocks user messages, in order."""
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolResultBlock):
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "content": _result_text(block)})
        else:
            raise invalid("a tool_use block belongs in an assistant message", f"{param}.{j}")
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _result_text(block: ToolResultBlock) -> str:
    content = block.content
    text = content if isinstance(content, str) else "\n".join(b.text for b in content or ())
    return f"Error: {text}" if block.is_error else text


def _tool_choice(req: MessagesRequest, parser: str | None) -> dict[str, Any]:
    """tool_choice (and parallel_tool_calls) of the chat request."""
    choice = req.tool_choice
    if not req.tools:
        if choice is not None and choice.type != "none":
            raise invalid(f"tool_choice {choice.type} needs tools", "tool_choice")
        return {}
    kind = "auto" if choice is None else choice.type
    out: dict[str, Any] = {}
    if choice is not None and choice.disable_parallel_tool_use:
        out["parallel_tool_calls"] = False
    if kind == "auto" and parser is None:
        raise invalid("tool_choice auto (the default with tools) needs the server started with "
                      "--tool-call-parser (hermes or llama3_json); use tool_choice {\"type\": "
                      "\"any\"} or {\"type\": \"tool\", \"name\": ...}, which the grammar "
                      "enforces", "tool_choice")
    if kind == "tool":
        names = [t.name for t in req.tools]
        if choice.name not in names:
            raise invalid(f"tool_choice names tool {choice.name!r}, which is not among the "
                          f"tools ({', '.join(names)})", "tool_choice")
        out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    return out
