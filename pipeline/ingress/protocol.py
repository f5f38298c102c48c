"""Request bodies of the OpenAI API (plus vLLM's sampling extras) and their SamplingParams.

Models are strict (no "1" -> 1 coercion, no bool for a number) and ignore unknown fields, as
vLLM does. Every optional field accepts an explicit null, so `"logprobs": null` or
`"best_of": 1` from a client written for OpenAI is accepted. Range checks live in
`SamplingParams.validate` and `validation.py`, which need the model's limits.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedserve.pipeline.ingress.errors import invalid
from pagedserve.pipeline.sampling_params import SamplingParams

Prompt = str | list[str] | list[int] | list[list[int]]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool | None = False


class _SamplingFields(_Body):
    """Fields both endpoints share; `None` means "the default"."""

    model: str | None = None
    n: int | None = None
    best_of: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    max_tokens: int | None = None
    min_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: int | None = None
    cache_salt: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check_common(self) -> None:
        """Field combinations no model limit is needed for."""
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options is only allowed when stream is true", "stream_options")
        n = 1 if self.n is None else self.n
        if self.best_of is not None and self.best_of != n:
            raise invalid(f"best_of ({self.best_of}) different from n ({n}) is not supported",
                          "best_of")
        if self.top_k == 0:  # SamplingParams reads 0 as "disabled"; the API asks for -1
            raise invalid("top_k must be -1 (disabled) or at least 1, got 0", "top_k")
        if self.logit_bias:
            raise invalid("logit_bias is not supported", "logit_bias")

    def sampling_params(self, *, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        given = {name: getattr(self, name) for name in _PASSTHROUGH if getattr(self, name) is not None}
        if isinstance(self.stop, str):
            given["stop"] = [self.stop]
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **given)


# Fields whose name and meaning are the same in the request and in SamplingParams.
_PASSTHROUGH = ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
                "frequency_penalty", "repetition_penalty", "seed", "min_tokens", "stop",
                "stop_token_ids", "ignore_eos", "skip_special_tokens",
                "include_stop_str_in_output")


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    echo: bool | None = False
    logprobs: int | None = None  # top-N besides the chosen token; null: none
    suffix: str | None = None

    def check(self) -> None:
        self.check_common()
        if self.suffix:
            raise invalid("suffix is not supported", "suffix")
        if self.echo and self.logprobs is not None:
            raise invalid("echo together with logprobs would need prompt logprobs, which this "
                          "server does not compute", "echo")

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list of texts or token-id lists; each must be non-empty."""
        p = self.prompt
        if isinstance(p, str):
            items: list[Any] = [p]
        elif p and isinstance(p[0], int):
            items = [p]
        else:
            items = list(p)
        if not items or any(len(x) == 0 for x in items):
            raise invalid("prompt must not be empty", "prompt")
        return items


class ContentPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def to_template(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        msg: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": content or ""}
        if self.name is not None:
            msg["name"] = self.name
        return msg


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        self.check_common()
        if self.top_logprobs and not self.logprobs:
            raise invalid("top_logprobs needs logprobs to be true", "top_logprobs")
        if self.tools:
            raise invalid("tools are not supported", "tools")
        if self.tool_choice not in (None, "none", "auto"):
            raise invalid("tool_choice is not supported", "tool_choice")
        if self.response_format and self.response_format.get("type") != "text":
            raise invalid("response_format other than text is not supported", "response_format")
        if self.add_generation_prompt and self.continue_final_message:
            raise invalid("add_generation_prompt and continue_final_message cannot both be true",
                          "continue_final_message")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0
