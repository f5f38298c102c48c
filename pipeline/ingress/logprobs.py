"""Logprobs in OpenAI's two shapes: completions' parallel lists and chat's list of entries."""
from __future__ import annotations

from typing import Any

from pagedserve.pipeline.ingress.errors import APIError
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


def prompt_part(token_text: TokenText, prompt_ids: list[int],
                prompt_logprobs: list[dict[int, float] | None] | None, num_top: int
                ) -> dict[str, Any]:
    """The echoed prompt's part of completions' logprobs: every prompt token, the first with
    null logprob and top_logprobs (nothing predicts it), `text_offset` from the choice's start.
    `prompt_logprobs` as RequestOutput holds them (each entry the engine's top-N in order,
    then the prompt's own token if it was not among them)."""
    entries = _every_position(prompt_ids, prompt_logprobs)
    tokens, offsets, chosen, tops, offset = [], [], [], [], 0
    for tid, entry in zip(prompt_ids, entries):
        text = token_text.text(tid)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            chosen.append(None)
            tops.append(None)
            continue
        top = {token_text.text(t): _lp(v) for t, v in list(entry.items())[:num_top]}
        top.setdefault(text, _lp(entry[tid]))
        chosen.append(_lp(entry[tid]))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": chosen, "top_logprobs": tops,
            "text_offset": offsets}


def joined(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Two parts of completions' logprobs, one after the other."""
    return {key: first[key] + second[key] for key in first}


def vllm_prompt_logprobs(token_text: TokenText, prompt_ids: list[int],
                         prompt_logprobs: list[dict[int, float] | None] | None
                         ) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs` of a completion choice: None for the first prompt token, then
    {token id: {"logprob", "decoded_token"}} of the top-N and the prompt's own token."""
    entries = _every_position(prompt_ids, prompt_logprobs)
    return [None if entry is None else
            {str(t): {"logprob": _lp(v), "decoded_token": token_text.text(t)}
             for t, v in entry.items()} for entry in entries]


def _every_position(prompt_ids: list[int], prompt_logprobs: list | None) -> list:
    """The prompt logprobs of every prompt token, or a 503 saying they did not all come."""
    entries = prompt_logprobs or [None]
    if len(entries) != len(prompt_ids):  # a detokenizer restart re-feeds no prompt logprobs
        raise APIError(503, f"the engine delivered the logprobs of {len(entries)} of the "
                       f"prompt's {len(prompt_ids)} tokens (a process of the server restarted "
                       "while this request ran); send it again", type="server_error",
                       code="prompt_logprobs_lost")
    return entries


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
