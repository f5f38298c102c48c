"""--reasoning-parser: a thinking model's `<think>...</think>` goes to `reasoning_content`, the
rest to `content`.

`deepseek_r1`: the template opens the thinking in the prompt, so the output is thinking until
`</think>` (a leading `<think>` is dropped); an output that never closes it is all thinking.
`qwen3`: thinking only when the output opens with `<think>`; otherwise all of it is content.
`split(text, final)` is prefix-consistent: as the text grows, both parts only grow, so a
stream's deltas assemble to the non-streamed message. A tag still being generated is held back.
"""
from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


def _held(text: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


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
        held = 0 if final else _held(body, CLOSE)
        return body[:len(body) - held], ""
    return body[:end], body[end + len(CLOSE):].lstrip()


class ReasoningStream:
    """One choice's reasoning/content deltas."""

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self.text = ""
        self.sent = [0, 0]  # reasoning, content

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(new reasoning, new content) for `text` appended."""
        self.text += text
        parts = split(self.parser, self.text, final)
        new = tuple(part[sent:] for part, sent in zip(parts, self.sent))
        self.sent = [len(p) for p in parts]
        return new


def answer_only(spec, parser: str, tokenizer):
    """`spec` (a StructuredOutputs) applied to the answer only: after the thinking ends."""
    import msgspec

    def ids(tag: str) -> list[int]:
        return list(tokenizer.encode(tag, add_special_tokens=False))
    start = [] if parser == "deepseek_r1" else ids(OPEN)
    return msgspec.structs.replace(spec, think_start=start, think_end=ids(CLOSE))
