"""What the client library and the offline API hand back to users."""
from __future__ import annotations

from dataclasses import dataclass, field


class RequestError(Exception):
    """A request the engine refused or could not finish; `status` follows HTTP (400, 503, ...)."""

    def __init__(self, status: int, message: str, request_id: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.request_id = request_id


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    # With SamplingParams.prompt_logprobs, as vLLM's: None for the first prompt token, then
    # per token {token id: logprob} holding the top-N and the prompt's own token.
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @classmethod
    def start(cls, request_id: str, prompt: str | None, prompt_token_ids: list[int],
              sampling) -> "RequestOutput":
        """Nothing received yet for a request with these SamplingParams: its n samples, and
        with prompt_logprobs the first prompt token's None (a one-token prompt has no more)."""
        return cls(request_id, prompt, prompt_token_ids,
                   [CompletionOutput(index=i) for i in range(sampling.n)],
                   prompt_logprobs=None if sampling.prompt_logprobs is None else [None])

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)

    def apply(self, delta) -> None:
        """Fold one TextDelta into the accumulated output."""
        if delta.prompt_logprobs is not None:
            self.add_prompt_logprobs(delta.prompt_logprobs)
        out = self.outputs[delta.index]
        out.text += delta.text
        out.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            out.logprobs = (out.logprobs or []) + list(delta.logprobs)
        if delta.top_logprobs is not None:
            out.top_logprobs = (out.top_logprobs or []) + [list(x) for x in delta.top_logprobs]
        if delta.finish_reason is not None:
            out.finish_reason = delta.finish_reason
            out.stop_reason = delta.stop_reason
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)

    def add_prompt_logprobs(self, chunk) -> None:
        """Append a chunk (messages.PromptLogprobs) that follows what is held; repeats of
        positions already held are skipped."""
        if self.prompt_logprobs is None:
            self.prompt_logprobs = [None]
        held = self.prompt_logprobs
        for position, (logprob, top) in enumerate(zip(chunk.logprobs, chunk.top_logprobs),
                                                  chunk.start):
            if position != len(held):
                continue
            entry = dict(top)
            entry.setdefault(self.prompt_token_ids[position], logprob)
            held.append(entry)


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]  # the pooled vector (normalized when the model's pooler says so)

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """What `LLM.embed` returns per prompt (vLLM's shape: `.outputs.embedding`)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
