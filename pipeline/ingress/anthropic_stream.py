"""A message's output in Anthropic's terms: content blocks of a whole message, and the
server-sent events of a streamed one.

Both read what chat_output.ChoiceShaper reads of the text (content, tool calls, reasoning), so a
stream's blocks assemble to the non-streamed message: text deltas are `text_delta`s, a tool
call's header opens a `tool_use` block and its argument fragments are `input_json_delta`s,
reasoning is a `thinking` block. Events are framed as Anthropic frames them:
`event: <type>` then `data: <JSON>`.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from pagedserve.pipeline.ingress.anthropic_errors import anthropic_error_body
from pagedserve.pipeline.ingress.errors import APIError
from pagedserve.pipeline.ingress.streaming import named_event as event


def tool_use_id(call_id: str) -> str:
    """Anthropic's tool_use ids start `toolu_`; the chat path makes `call_<hex>` ids."""
    return "toolu_" + call_id.removeprefix("call_")


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's raw argument text as the `input` object ({} when it is not a JSON object)."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def stop_fields(finish_reason: str | None, stop_reason: int | str | None, called: bool,
                stop_sequences: list[str] | None) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a finished message."""
    if called:
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop_reason, str) and stop_reason in (stop_sequences or ()):
        return "stop_sequence", stop_reason
    return ("end_turn", None) if finish_reason is not None else (None, None)


def content_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """The blocks of an assistant message as ChoiceShaper.message shapes it."""
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"],
                       "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        blocks.append({"type": "tool_use", "id": tool_use_id(call["id"]),
                       "name": call["function"]["name"],
                       "input": tool_input(call["function"]["arguments"])})
    if not blocks:
        blocks.append({"type": "text", "text": ""})
    return blocks


class BlockEvents:
    """Turns a choice's chat deltas ({"content"}, {"reasoning_content"}, {"tool_calls"}) into
    content block events: one block open at a time, closed when another kind starts."""

    def __init__(self) -> None:
        self.index = -1
        self.open_kind: str | None = None
        self.pinged = False

    def feed(self, part: dict[str, Any]) -> list[bytes]:
        if "content" in part:
            return self._delta("text", {"type": "text", "text": ""},
                               {"type": "text_delta", "text": part["content"]})
        if "reasoning_content" in part:
            return self._delta("thinking", {"type": "thinking", "thinking": "", "signature": ""},
                               {"type": "thinking_delta", "thinking": part["reasoning_content"]})
        out: list[bytes] = []
        for call in part.get("tool_calls") or ():
            fn = call.get("function") or {}
            if "id" in call:  # a new call's header: a block of its own
                out += self._close()
                out += self._start("tool_use", {"type": "tool_use", "id": tool_use_id(call["id"]),
                                                "name": fn.get("name", ""), "input": {}})
            if fn.get("arguments"):
                out.append(self._event_delta({"type": "input_json_delta",
                                              "partial_json": fn["arguments"]}))
        return out

    def finish(self) -> list[bytes]:
        """Close the open block (an empty text block when none was opened)."""
        out = [] if self.open_kind else self._start("text", {"type": "text", "text": ""})
        return out + self._close()

    def _delta(self, kind: str, start: dict[str, Any], delta: dict[str, Any]) -> list[bytes]:
        out = [] if self.open_kind == kind else self._close() + self._start(kind, start)
        return out + [self._event_delta(delta)]

    def _start(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        self.index += 1
        self.open_kind = kind
        out = [event({"type": "content_block_start", "index": self.index, "content_block": block})]
        if not self.pinged:  # Anthropic pings after the first block opens
            self.pinged = True
            out.append(event({"type": "ping"}))
        return out

    def _event_delta(self, delta: dict[str, Any]) -> bytes:
        return event({"type": "content_block_delta", "index": self.index, "delta": delta})

    def _close(self) -> list[bytes]:
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [event({"type": "content_block_stop", "index": self.index})]


async def with_anthropic_error_event(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """An error after the headers went out is an `error` event that ends the stream."""
    try:
        async for chunk in chunks:
            yield chunk
    except APIError as exc:
        yield event(anthropic_error_body(exc.status, exc.message))
