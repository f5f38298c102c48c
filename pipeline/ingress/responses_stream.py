"""A response's output in the Responses API's terms: the output items of a whole response, and
the server-sent events of a streamed one.

Both read what chat_output.ChoiceShaper reads of the text (content and tool calls), so a stream's
items assemble to the non-streamed output: text deltas are `response.output_text.delta`s of a
`message` item, a tool call's header opens a `function_call` item and its argument fragments are
`response.function_call_arguments.delta`s. Reasoning (--reasoning-parser) is left out of both.
Events are framed as OpenAI frames them: `event: <type>` then `data: <JSON>`, each with its
`sequence_number`.
"""
from __future__ import annotations

from typing import Any

from pagedserve.pipeline.ingress.streaming import named_event as event


def call_item_id(call_id: str) -> str:
    """The function_call item's id (`fc_…`) beside its `call_id` (the chat path's `call_…`)."""
    return "fc_" + call_id.removeprefix("call_")


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [text_part(text)] if status == "completed" else []}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed"
              ) -> dict[str, Any]:
    return {"type": "function_call", "id": call_item_id(call_id), "call_id": call_id,
            "name": name, "arguments": arguments, "status": status}


def output_items(message: dict[str, Any], message_id: str) -> list[dict[str, Any]]:
    """The items of an assistant message as ChoiceShaper.message shapes it: its text (an empty
    one when it has neither text nor calls), then its calls."""
    calls = [call_item(c["id"], c["function"]["name"], c["function"]["arguments"])
             for c in message.get("tool_calls") or ()]
    text = message.get("content") or ""
    return ([message_item(message_id, text)] if text or not calls else []) + calls


def usage(input_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens,
            "total_tokens": input_tokens + output_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}


class OutputEvents:
    """Turns a response's chat deltas ({"content"}, {"tool_calls"}) into output item events:
    one item open at a time, closed when another starts. `output` holds the finished items."""

    def __init__(self, message_id: str) -> None:
        self.message_id = message_id
        self.sequence_number = 0
        self.output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None

    def emit(self, payload: dict[str, Any]) -> bytes:
        payload["sequence_number"] = self.sequence_number
        self.sequence_number += 1
        return event(payload)

    def feed(self, part: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        if part.get("content"):
            if self._open is None or self._open["type"] != "message":
                out += self._close() + self._open_message()
            self._open["text"] += part["content"]
            out.append(self.emit({"type": "response.output_text.delta", **self._where(),
                                  "content_index": 0, "delta": part["content"], "logprobs": []}))
        for call in part.get("tool_calls") or ():
            fn = call.get("function") or {}
            if "id" in call:  # a new call's header: an item of its own
                out += self._close()
                self._open = call_item(call["id"], fn.get("name", ""), "", "in_progress")
                out.append(self._added(self._open))
            if fn.get("arguments") and self._open is not None:
                self._open["arguments"] += fn["arguments"]
                out.append(self.emit({"type": "response.function_call_arguments.delta",
                                      **self._where(), "delta": fn["arguments"]}))
        return out

    def finish(self) -> list[bytes]:
        """Close the open item (an empty message when none was opened)."""
        out = [] if self._open is not None or self.output else self._open_message()
        return out + self._close()

    def _where(self) -> dict[str, Any]:
        return {"item_id": self._open["id"], "output_index": len(self.output)}

    def _added(self, item: dict[str, Any]) -> bytes:
        shown = {k: v for k, v in item.items() if k != "text"}
        return self.emit({"type": "response.output_item.added", "output_index": len(self.output),
                          "item": shown})

    def _open_message(self) -> list[bytes]:
        self._open = {**message_item(self.message_id, "", "in_progress"), "text": ""}
        return [self._added(self._open),
                self.emit({"type": "response.content_part.added", **self._where(),
                           "content_index": 0, "part": text_part("")})]

    def _close(self) -> list[bytes]:
        item, out = self._open, []
        if item is None:
            return out
        where = self._where()
        if item["type"] == "message":
            text = item.pop("text")
            done = message_item(item["id"], text)
            out.append(self.emit({"type": "response.output_text.done", **where,
                                  "content_index": 0, "text": text, "logprobs": []}))
            out.append(self.emit({"type": "response.content_part.done", **where,
                                  "content_index": 0, "part": text_part(text)}))
        else:
            done = {**item, "status": "completed"}
            out.append(self.emit({"type": "response.function_call_arguments.done", **where,
                                  "name": item["name"], "arguments": item["arguments"]}))
        out.append(self.emit({"type": "response.output_item.done",
                              "output_index": where["output_index"], "item": done}))
        self.output.append(done)
        self._open = None
        return out
