"""Logprobs in OpenAI's two shapes: completions' parallel lists and chat's list of entries."""
from __future__ import annotations

from typing import Any

from pagedserve.pipeline.ingress.tokens import TokenText

_FLOOR = -9999.0  # -inf is not JSON; vLLM clamps the same way


def _lp(value: float | None) -> float | None:
    return None if value is None else max(float(value), _FLOOR)


def _per_token(values: list | None, count: int) -> list:
    return list(values) if values is not None and len(values) == count else [None] * count


class CompletionLogprobs:
    """Accumulates `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}` of one choice;
    `text_offset` counts characters from the start of the choice's text (after any echo)."""

    def __init__(self, token_text: TokenText, text_offset: int = 0):
        self.token_text = token_text
        self.offset = text_offset

    def chunk(self, token_ids: list[int], logprobs: list[float] | None,
              top_logprobs: list[list[tuple[int, float]]] | None) -> dict[str, Any]:
        tokens, offsets, tops = [], [], []
        for tid, lp, top in zip(token_ids, _per_token(logprobs, len(token_ids)),
                                _per_token(top_logprobs, len(token_ids))):
            text = self.token_text.text(tid)
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(text)
            entry = {self.token_text.text(t): _lp(v) for t, v in (top or ())}
            if lp is not None:
                entry.setdefault(text, _lp(lp))  # the sampled token is always listed
            tops.append(entry)
        return {"tokens": tokens, "token_logprobs": [_lp(x) for x in
                                                      _per_token(logprobs, len(token_ids))],
                "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(token_text: TokenText, token_ids: list[int], logprobs: list[float] | None,
                  top_logprobs: list[list[tuple[int, float]]] | None, num_top: int) -> dict[str, Any]:
    content = []
    for tid, lp, top in zip(token_ids, _per_token(logprobs, len(token_ids)),
                            _per_token(top_logprobs, len(token_ids))):
        content.append({
            "token": token_text.text(tid), "logprob": _lp(lp), "bytes": token_text.bytes(tid),
            "top_logprobs": [{"token": token_text.text(t), "logprob": _lp(v),
                              "bytes": token_text.bytes(t)} for t, v in (top or ())[:num_top]],
        })
    return {"content": content}
