"""One client stream through the router, and how it continues on another replica.

Upstream streams are asked for `return_token_ids`, so the router knows the prompt's token ids
and every token sent so far. When the replica dies or stops answering, the rest is asked of
another replica as a completion of prompt + the tokens whose text the client has all of
(`delivery.py`: text a replica held back, for a stop string or an unfinished character, was
never sent), with the remaining `max_tokens`: the engine computes those tokens as prompt and
continues, so for greedy and seeded sampling (the sampler's randomness depends only on the seed
and the position) the client sees the same tokens as without the fault, none lost or repeated.
The continuation's completion chunks are reshaped as the original stream's (chat or
completion) chunks.

A continuation is a plain completion: what shapes the output beyond sampling (a grammar from
`response_format`, `structured_outputs` or `guided_*`; tools; a reasoning parser's
`reasoning_content`) would start again at its first token, so such a stream is not resumed but
ends with an error event naming the cause.

Pure: events in, events out.
"""
from __future__ import annotations

from typing import Any

from pagedserve.pipeline.ingress.validation import DEFAULT_COMPLETION_MAX_TOKENS
from pagedserve.pipeline.router.delivery import Delivery, Replay, ReplayDiverged

__all__ = ["ReplayDiverged", "ResumableStream", "output_constraint"]

# Sampling fields a continuation keeps; the others (n, echo, logprobs, stream_options ...)
# are the router's to set or are refused for resumption.
_CARRIED = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
            "ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "logit_bias",
            "priority", "cache_salt", "user")
# Penalties count output tokens, which the continuation sends as prompt: not resumed exactly.
_NOT_RESUMABLE = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs",
                  "top_logprobs", "echo")
# Asked for even as 0 (the top-0: the token's own logprob); prompt_logprobs go out with a
# stream's first chunk, which a continuation would not repeat.
_ASKED_AS_ZERO = ("logprobs", "top_logprobs", "prompt_logprobs")
# Output constraints compiled into a grammar from the first output token on.
_GRAMMARS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice",
             "guided_grammar")
_PLAIN_DELTA = frozenset({"role", "content"})


def output_constraint(body: dict[str, Any]) -> str | None:
    """The field that constrains or shapes the output beyond sampling, if any."""
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        return "response_format"
    for name in _GRAMMARS:
        if body.get(name) is not None:
            return name
    if body.get("tools") and body.get("tool_choice") != "none":
        return "tools"
    return None


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
        stop = body.get("stop")
        self.delivery = Delivery([stop] if isinstance(stop, str) else
                                 stop if isinstance(stop, list) else ())
        self.generated_tokens = 0      # sent to the client, every choice: what the key is charged
        self.finished = False
        self.resumed = 0               # how many continuations were started
        self.envelope: dict[str, Any] | None = None  # id, created, model of the first chunk
        self.shaped: str | None = None  # a delta field beyond content the replica sent
        self._replay: Replay | None = None

    # -- what goes upstream ------------------------------------------------------------------
    def upstream_body(self) -> dict[str, Any]:
        """The client's body, asking for token ids (stripped again before the client)."""
        return {**self.body, "return_token_ids": True}

    def why_not_resumable(self) -> str | None:
        if (self.body.get("n") or 1) != 1:
            return "it has n > 1"
        if self._is_batch():
            return "it is a batch of prompts"
        for name in _NOT_RESUMABLE:
            if self.body.get(name) not in (None, False):
                return f"it asks for {name}"
        for name in _ASKED_AS_ZERO:
            if type(self.body.get(name)) is int:
                return f"it asks for {name}"
        constraint = output_constraint(self.body)
        if constraint:
            return (f"its output is constrained by {constraint}, which a continuation would "
                    "apply again from its first token")
        if self.shaped:
            return f"its replica shaped the output ({self.shaped}), a continuation cannot"
        if self.prompt_token_ids is None:
            return "the replica never sent its prompt's token ids"
        return None

    def started(self) -> bool:
        """Whether the client has received anything generated (then a retry must resume)."""
        return self.delivery.num_tokens > 0 or self.envelope is not None

    def prompt_tokens(self, estimate: int) -> int:
        """The prompt's tokens as the replica counted them, else `estimate` (a batch's prompts
        are not all counted here)."""
        if self.prompt_token_ids is None or self._is_batch():
            return estimate
        return len(self.prompt_token_ids)

    def _is_batch(self) -> bool:
        prompt = self.body.get("prompt")
        return self.kind == "completion" and isinstance(prompt, list) and bool(prompt) and \
            not isinstance(prompt[0], int)

    def continuation_body(self, upstream_model: str, max_model_len: int) -> dict[str, Any]:
        """A streamed completion of prompt + the confirmed outputs, for the tokens still owed
        (the tail is generated again: `begin_continuation`)."""
        done = len(self.delivery.confirmed_ids)
        prompt = list(self.prompt_token_ids or []) + self.delivery.confirmed_ids
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
        """The next upstream events are a continuation's; the tail they repeat is dropped."""
        self.resumed += 1
        self._replay = Replay(list(self.delivery.tail_ids), self.delivery.tail_text)

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
        ids = ids if isinstance(ids, list) else []
        self.generated_tokens += len(ids)
        if choice.get("index", 0) == 0:
            self.delivery.sent(ids, self._text(choice))
        if choice.get("finish_reason") is not None and (self.body.get("n") or 1) == 1:
            self.finished = True

    def _text(self, choice: dict[str, Any]) -> str:
        """The text a choice of the original stream carries to the client."""
        if self.kind == "completion":
            text = choice.get("text")
        else:
            delta = choice.get("delta") or {}
            shaped = [k for k, v in delta.items() if k not in _PLAIN_DELTA and v is not None]
            if shaped and self.shaped is None:
                self.shaped = shaped[0]
            text = delta.get("content")
        return text if isinstance(text, str) else ""

    def _continued(self, event: dict[str, Any]) -> dict[str, Any] | None:
        """A continuation's completion chunk, reshaped as the original stream's, without what
        it repeats of the tail (ReplayDiverged when that differs from what was sent)."""
        choices = event.get("choices") or []
        if not choices:
            return None  # a continuation's usage counts resent tokens as prompt: see usage_event
        src = choices[0]
        src.pop("prompt_token_ids", None)
        finish = src.get("finish_reason")
        ids, text = self._replay.cut(list(src.get("token_ids") or []), src.get("text") or "")
        if finish is not None and not self._replay.done:
            raise ReplayDiverged(f"it finished ({finish}) before repeating all that was sent")
        self.generated_tokens += len(ids)
        self.delivery.sent(ids, text)
        if finish is not None:
            self.finished = True
        if not (text or ids or finish):
            return None
        if self.kind == "completion":
            choice = {"index": 0, "text": text, "logprobs": None,
                      "finish_reason": finish, "stop_reason": src.get("stop_reason")}
            obj = "text_completion"
        else:
            choice = {"index": 0, "delta": {"content": text} if text else {},
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
        done = self.delivery.num_tokens
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**(self.envelope or {}), "object": obj, "choices": [],
                "usage": {"prompt_tokens": prompt, "completion_tokens": done,
                          "total_tokens": prompt + done}}
