"""One chat choice's text as OpenAI shapes it: reasoning_content (--reasoning-parser), then
content or tool_calls (tools.ToolPlan). The streamed deltas and the non-streamed message read
the text the same way, so the deltas assemble to the message. Per delta, the work is linear in
the delta (reasoning.ReasoningStream, tool_stream.ToolDeltaStream): the text so far is read
again only once, at the end, for the final reading."""
from __future__ import annotations

from typing import Any

from pagedserve.pipeline.ingress import tools
from pagedserve.pipeline.ingress.reasoning import ReasoningStream, split
from pagedserve.pipeline.ingress.tool_stream import ToolDeltaStream


class ChoiceShaper:
    def __init__(self, tool_plan: tools.ToolPlan | None, reasoning_parser: str | None) -> None:
        self.tool_plan = tool_plan if tool_plan is not None and tool_plan.mode != "none" else None
        self.reasoning_parser = reasoning_parser
        self._reasoning = ReasoningStream(reasoning_parser) if reasoning_parser else None
        self._tools = ToolDeltaStream(self.tool_plan, tools.new_call_id) if self.tool_plan else None

    @property
    def plain(self) -> bool:
        return self.tool_plan is None and self.reasoning_parser is None

    def message(self, text: str) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant"}
        content = text
        if self.reasoning_parser:
            reasoning, content = split(self.reasoning_parser, text, final=True)
            msg["reasoning_content"] = reasoning or None
        if self.tool_plan is None:
            msg["content"] = content
            return msg
        return {**msg, **tools.message(self.tool_plan, content)}

    def finish_reason(self, text: str, reason: str | None) -> str | None:
        """OpenAI's finish_reason is tool_calls when the choice ended in calls."""
        if reason == "stop" and self.tool_plan is not None:
            content = split(self.reasoning_parser, text, True)[1] if self.reasoning_parser else text
            if tools.has_calls(self.tool_plan, content):
                return "tool_calls"
        return reason

    def deltas(self, text: str, final: bool) -> list[dict[str, Any]]:
        """The delta objects for `text` appended to this choice (final: its last text)."""
        out: list[dict[str, Any]] = []
        content = text
        if self._reasoning is not None:
            reasoning, content = self._reasoning.feed(text, final)
            if reasoning:
                out.append({"reasoning_content": reasoning})
        if self._tools is None:
            if content:
                out.append({"content": content})
            return out
        return out + self._tools.feed(content, final)

    @property
    def called(self) -> bool:
        return self._tools is not None and self._tools.called
