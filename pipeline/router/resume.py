"""One client stream through the router, and how it continues on another replica.

Upstream streams are asked for `return_token_ids`, so the router knows the prompt's token ids
and every token sent so far. When the replica dies or stops answering, the rest is asked of
another replica as a completion of prompt + the tokens already sent, with the remaining
`max_tokens`: the engine computes those tokens as prompt and continues, so for greedy and
seeded sampling (the sampler's randomness depends only on the seed and the position) the
client sees the same tokens as without the fault, none lost or repeated. The continuation's
completion chunks are reshaped as the original stream's (chat or completion) chunks.

Pure: events in, events out.
"""
from __future__ import annotations

from typing import Any

from pagedserve.pipeline.ingress.validation import DEFAULT_COMPLETION_MAX_TOKENS

# Sampling fields a continuation keeps; the others (n, echo, logprobs, stream_options ...)
# are the router's to set or are refused for resumption.
_CARRIED = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
            "ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "logit_bias",
            "priority", "cache_salt", "user")
# Penalties count output tokens, which the continuation sends as prompt: not resumed exactly.
_NOT_RESUMABLE = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs",
                  "top_logprobs", "echo")


class ResumableStream:
    """The state of one streamed request: what the client got, what a continuation needs."""

    def __init__(self, kind: str, body: dict[str, Any]):
        if kind not in ("chat", "completion"):
            raise ValueError(f"unknown request kind {kind!r}")
        self.kind = kind
        self.body = body
        self.client_wants_ids = bool(body.get("return_token_ids"))
        self.include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        self.prompt_token_ids: list[int] | None = None
        self.output_token_ids: list[int] = []
        self.finished = False
        self.resumed = 0               # how many continuations were started
        self.envelope: dict[str, Any] | None = None  # id, created, model of the first chunk

    # -- what goes upstream ------------------------------------------------------------------
    def upstream_body(self) -> dict[str, Any]:
        """The client's body, asking for token ids (stripped again before the client)."""
        return {**self.body, "return_token_ids": True}

    def why_not_resumable(self) -> str | None:
        if (self.body.get("n") or 1) != 1:
            return "it has n > 1"
        if self.kind == "completion" and isinstance(self.body.get("prompt"), list) and \
                self.body["prompt"] and not isinstance(self.body["prompt"][0], int):
            return "it is a batch of prompts"
        for name in _NOT_RESUMABLE:
            if self.body.get(name) not in (None, False):
                return f"it asks for {name}"
        if self.prompt_token_ids is None:
            return "the replica never sent its prompt's token ids"
        return None

    def started(self) -> bool:
        """Whether the client has received anything generated (then a retry must resume)."""
        return bool(self.output_token_ids) or self.envelope is not None

    def continuation_body(self, upstream_model: str, max_model_len: int) -> dict[str, Any]:
        """A streamed completion of prompt + outputs so far, for the tokens still owed."""
        done = len(self.output_token_ids)
        prompt = list(self.prompt_token_ids or []) + self.output_token_ids
        body = {name: self.body[name] for name in _CARRIED if self.body.get(name) is not None}
        requested = self.body.get("max_completion_tokens") or self.body.get("max_tokens")
        if requested is None and self.kind == "completion":
            requested = DEFAULT_COMPLETION_MAX_TOKENS
        remaining = (requested - done if requested is not None
                     else max(1, max_model_len - len(prompt)))
        if self.body.get("min_tokens"):
            body["min_tokens"] = max(0, self.body["min_tokens"] - done)
        body.update(model=upstream_model, prompt=prompt, max_tokens=max(1, remaining),
                    stream=True, return_token_ids=True)
        return body

    def begin_continuation(self) -> None:
        self.resumed += 1

    # -- what comes back ---------------------------------------------------------------------
    def feed(self, event: dict[str, Any]) -> dict[str, Any] | None:
        """An upstream SSE event (parsed JSON) -> the event for the client (None: drop it)."""
        if "error" in event:
            return event
        if self.resumed:
            return self._continued(event)
        if self.envelope is None:
            self.envelope = {k: event.get(k) for k in ("id", "created", "model")}
        if self.kind == "chat" and "prompt_token_ids" in event:
            self.prompt_token_ids = event.pop("prompt_token_ids")
        for choice in event.get("choices") or ():
            self._record(choice)
        return event

    def _record(self, choice: dict[str, Any]) -> None:
        if "prompt_token_ids" in choice:
            ids = choice.pop("prompt_token_ids")
            if choice.get("index", 0) == 0:
                self.prompt_token_ids = ids
        ids = choice.get("token_ids") if self.client_wants_ids else choice.pop("token_ids", None)
        if ids and choice.get("index", 0) == 0:
            self.output_token_ids.extend(ids)
        if choice.get("finish_reason") is not None and (self.body.get("n") or 1) == 1:
            self.finished = True

    def _continued(self, event: dict[str, Any]) -> dict[str, Any] | None:
        """A continuation's completion chunk, reshaped as the original stream's."""
        choices = event.get("choices") or []
        if not choices:
            return None  # a continuation's usage counts resent tokens as prompt: see usage_event
        src = choices[0]
        src.pop("prompt_token_ids", None)
        ids = src.get("token_ids") or []
        self.output_token_ids.extend(ids)
        finish = src.get("finish_reason")
        if finish is not None:
            self.finished = True
        if not (src.get("text") or ids or finish):
            return None
        if self.kind == "completion":
            choice = {"index": 0, "text": src.get("text", ""), "logprobs": None,
                      "finish_reason": finish, "stop_reason": src.get("stop_reason")}
            obj = "text_completion"
        else:
            choice = {"index": 0, "delta": {"content": src["text"]} if src.get("text") else {},
                      "logprobs": None, "finish_reason": finish}
            if finish is not None:
                choice["stop_reason"] = src.get("stop_reason")
            obj = "chat.completion.chunk"
        if self.client_wants_ids:
            choice["token_ids"] = ids
        out = {**(self.envelope or {}), "object": obj, "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return out

    def usage_event(self) -> dict[str, Any] | None:
        """The usage chunk that ends a resumed stream, counted by the router; None when the
        client did not ask for usage."""
        if not self.include_usage:
            return None
        prompt = len(self.prompt_token_ids or [])
        done = len(self.output_token_ids)
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**(self.envelope or {}), "object": obj, "choices": [],
                "usage": {"prompt_tokens": prompt, "completion_tokens": done,
                          "total_tokens": prompt + done}}
