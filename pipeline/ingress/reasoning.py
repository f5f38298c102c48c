"""--reasoning-parser: a thinking model's `<think>...</think>` goes to `reasoning_content`, the
rest to `content`.

`deepseek_r1`: the template opens the thinking in the prompt, so the output is thinking until
`</think>` (a leading `<think>` is dropped); an output that never closes it is all thinking.
`qwen3`: thinking only when the output opens with `<think>`; otherwise all of it is content.
`split(text, final)` is prefix-consistent: as the text grows, both parts only grow, so a
stream's deltas assemble to the non-streamed message. A tag still being generated is held back.
"""
from __future__ import annotations

from pagedserve.pipeline.ingress.marker_scan import MarkerScan, held_prefix

OPEN, CLOSE = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


def split(parser: str, text: str, final: bool) -> tuple[str, str]:
    """(reasoning, content) of the output so far."""
    body = text.lstrip()
    opened = body.startswith(OPEN)
    if not opened and not final and OPEN.startswith(body):
        return "", ""  # the opening tag may still be on its way
    if parser == "qwen3" and not opened:
        return "", text
    if opened:
        body = body[len(OPEN):]
    end = body.find(CLOSE)
    if end < 0:
        held = 0 if final else held_prefix(body, CLOSE)
        return body[:len(body) - held], ""
    return body[:end], body[end + len(CLOSE):].lstrip()


class ReasoningStream:
    """One choice's reasoning/content deltas, as `split` reads the text so far, each delta read
    once: the opening tag is decided on its few characters, `</think>` is found by a
    MarkerScan, and the text so far is joined only for the final reading."""

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self._chunks: list[str] = []
        self.sent = [0, 0]  # reasoning, content
        self._phase = "opening"      # then "thinking", "answer_start" (whitespace), "answer"
        self._opening = ""           # the output so far, less leading whitespace, while undecided
        self._close = MarkerScan(CLOSE)

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(new reasoning, new content) for `text` appended."""
        self._chunks.append(text)
        if final:
            whole = "".join(self._chunks)
            self._chunks = [whole]
            parts = split(self.parser, whole, True)
            new = (parts[0][self.sent[0]:], parts[1][self.sent[1]:])
        else:
            new = self._read(text)
        self.sent = [self.sent[0] + len(new[0]), self.sent[1] + len(new[1])]
        return new

    def _read(self, text: str) -> tuple[str, str]:
        if self._phase == "opening":
            body = (self._opening + text).lstrip()
            if body.startswith(OPEN):
                self._phase, text = "thinking", body[len(OPEN):]
            elif OPEN.startswith(body):
                self._opening = body  # the opening tag may still be on its way
                return "", ""
            elif self.parser == "qwen3":  # no thinking: all of it is the answer, as it came
                self._phase = "answer"
                return "", "".join(self._chunks)
            else:
                self._phase, text = "thinking", body
        reasoning = ""
        if self._phase == "thinking":
            reasoning, after = self._close.feed(text)
            if after is None:
                return reasoning, ""
            self._phase, text = "answer_start", text[after:]
        if self._phase == "answer_start":
            text = text.lstrip()
            if text:
                self._phase = "answer"
        return reasoning, text


def answer_only(spec, parser: str, tokenizer):
    """`spec` (a StructuredOutputs) applied to the answer only: after the thinking ends."""
    import msgspec

    def ids(tag: str) -> list[int]:
        return list(tokenizer.encode(tag, add_special_tokens=False))
    start = [] if parser == "deepseek_r1" else ids(OPEN)
    return msgspec.structs.replace(spec, think_start=start, think_end=ids(CLOSE))
