"""Request bodies of the OpenAI API (plus vLLM's sampling extras) and their SamplingParams.

Models are strict (no "1" -> 1 coercion, no bool for a number) and ignore unknown fields, as
vLLM does. Every optional field accepts an explicit null, so `"logprobs": null` or
`"best_of": 1` from a client written for OpenAI is accepted. Range checks live in
`SamplingParams.validate` and `validation.py`, which need the model's limits.

The OpenAPI schema documents those ranges (`documented`) without checking them, so that a bad value
still meets the one gate and its OpenAI-shaped 400 naming the field. A bound that depends on
the served model is a marker (`LIMIT_KEY`) that `openapi.py` fills in.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from pagedserve.pipeline.ingress.errors import invalid
from pagedserve.pipeline.ingress.limits import MAX_CHAT_MESSAGES, MAX_TOOLS
from pagedserve.pipeline.ingress.structured_fields import structured_spec
from pagedserve.pipeline.ingress.tools import template_messages_args
from pagedserve.pipeline.sampling_params import (INT64_MAX, INT64_MIN, MAX_LOGIT_BIAS,
                                                 MAX_LOGIT_BIAS_ENTRIES, MAX_LOGPROBS,
                                                 MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS,
                                                 MAX_STOP_TOKEN_IDS, SamplingParams, check_count)

LIMIT_KEY = "x-pagedserve-limit"  # replaced by "maximum": the served model's limit of that name


def documented(tp: Any, **schema: Any) -> Any:
    """`tp`, validated as `tp`, shown in the OpenAPI schema as `schema` (its documented range)."""
    return Annotated[tp, WithJsonSchema(schema)]


INT64_SCHEMA = {"type": "integer", "minimum": INT64_MIN, "maximum": INT64_MAX}
_TOKEN_ID = {"type": "integer", "minimum": 0, LIMIT_KEY: "token_id"}
_TEXT = {"type": "string", "minLength": 1}
STOP_SCHEMA = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_STRING_CHARS}

Prompt = (documented(str, **_TEXT)
          | documented(list[str], type="array", minItems=1, items=_TEXT, **{LIMIT_KEY: "prompts"})
          | documented(list[int], type="array", minItems=1, items=_TOKEN_ID)
          | documented(list[list[int]], type="array", minItems=1, **{LIMIT_KEY: "prompts"},
                 items={"type": "array", "minItems": 1, "items": _TOKEN_ID}))


class RequestBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(RequestBody):
    include_usage: bool | None = False


class SamplingFields(RequestBody):
    """Fields both endpoints share; `None` means "the default"."""

    model: str | None = None
    n: documented(int, type="integer", minimum=1, **{LIMIT_KEY: "n"}) | None = None
    best_of: int | None = Field(None, description="must equal n when given")
    temperature: documented(float, type="number", minimum=0, maximum=2) | None = None
    top_p: documented(float, type="number", exclusiveMinimum=0, maximum=1) | None = None
    top_k: documented(int, type="integer", minimum=-1, maximum=INT64_MAX, **{"not": {"const": 0}}
                ) | None = Field(None, description="-1 disables")
    min_p: documented(float, type="number", minimum=0, maximum=1) | None = None
    presence_penalty: documented(float, type="number", minimum=-2, maximum=2) | None = None
    frequency_penalty: documented(float, type="number", minimum=-2, maximum=2) | None = None
    repetition_penalty: documented(float, type="number", exclusiveMinimum=0, maximum=2) | None = None
    seed: documented(int, **INT64_SCHEMA) | None = None
    max_tokens: documented(int, type="integer", minimum=1, **{LIMIT_KEY: "max_tokens"}) | None = Field(
        None, description="prompt tokens + max_tokens must fit the model's context")
    min_tokens: documented(int, type="integer", minimum=0) | None = None
    stop: documented(str, **STOP_SCHEMA) | documented(list[str], type="array", items=STOP_SCHEMA,
                                    maxItems=MAX_STOP_STRINGS) | None = None
    stop_token_ids: documented(list[int], type="array", items=_TOKEN_ID,
                         maxItems=MAX_STOP_TOKEN_IDS) | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    logit_bias: documented(dict[str, float], type="object", maxProperties=MAX_LOGIT_BIAS_ENTRIES,
                     propertyNames={"pattern": "^[0-9]+$"},
                     additionalProperties={"type": "number", "minimum": -MAX_LOGIT_BIAS,
                                           "maximum": MAX_LOGIT_BIAS},
                     description="token id (inside the vocabulary) -> bias added to its logit"
                     ) | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = Field(None, description="only when stream is true")
    user: str | None = None
    priority: documented(int, **INT64_SCHEMA) | None = Field(None, description="lower runs first (priority "
                                                 "scheduling)")
    cache_salt: str | None = None
    response_format: documented(dict[str, Any], type="object") | None = Field(
        None, description="{type: text | json_object | json_schema}; json_schema: {name, schema}")
    structured_outputs: documented(dict[str, Any], type="object") | None = Field(
        None, description="one of json (a schema), regex, choice, grammar (EBNF), "
                          "structural_tag, json_object")
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    return_token_ids: bool | None = Field(
        None, description="also send the token ids: each choice's `token_ids`, and the prompt's "
        "`prompt_token_ids` (first chunk of a stream); the router resumes streams with them")

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
        for name in ("top_k", "priority"):  # unbounded above otherwise; they go on the wire
            value = getattr(self, name)
            if value is not None and not INT64_MIN <= value <= INT64_MAX:
                raise invalid(f"{name} must fit in a signed 64-bit integer, got {value}", name)

    def sampling_params(self, *, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises ValueError naming the field (see validation.validated_params)."""
        given = {name: getattr(self, name) for name in _PASSTHROUGH if getattr(self, name) is not None}
        if isinstance(self.stop, str):
            given["stop"] = [self.stop]
        if self.logit_bias:
            given["logit_bias"] = token_bias(self.logit_bias)
        spec = structured_spec(self)
        if spec is not None:
            given["structured_outputs"] = spec
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **given)


def token_bias(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's logit_bias keys are token ids written as JSON object keys (strings); the range
    of the ids and the values is SamplingParams.validate's to check."""
    check_count("logit_bias", len(bias), MAX_LOGIT_BIAS_ENTRIES, "entries")
    out = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 19):
            raise ValueError(f"logit_bias key {key[:40]!r} is not a token id (a non-negative "
                             "integer)")
        out[int(key)] = value
    return out


# Fields whose name and meaning are the same in the request and in SamplingParams.
_PASSTHROUGH = ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
                "frequency_penalty", "repetition_penalty", "seed", "min_tokens", "stop",
                "stop_token_ids", "ignore_eos", "skip_special_tokens",
                "include_stop_str_in_output")


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: documented(int, type="integer", minimum=0, **{LIMIT_KEY: "max_tokens"}) | None = Field(
        None, description="prompt tokens + max_tokens must fit the model's context; 0 only "
        "with echo: the prompt (and with logprobs its logprobs) alone")
    echo: bool | None = Field(False, description="the prompt before the completion; with "
                              "logprobs, the prompt tokens' logprobs first (the first: null)")
    logprobs: documented(int, type="integer", minimum=0, maximum=MAX_LOGPROBS) | None = Field(
        None, description="top-N besides the chosen token; null: none")
    prompt_logprobs: documented(int, type="integer", minimum=0, maximum=MAX_LOGPROBS) | None = Field(
        None, description="vLLM's: each choice's `prompt_logprobs`, per prompt token after the "
        "first its logprob and the top-N (token id -> {logprob, decoded_token})")
    suffix: str | None = Field(None, description="the text after the gap: the prompt is "
                               "what comes before it, the completion fills it (a model with "
                               "fill-in-the-middle tokens; empty: a plain completion)")

    def check(self) -> None:
        self.check_common()
        if self.max_tokens is not None and self.max_tokens < 0:
            raise invalid(f"max_tokens must be at least 0 (0 with echo: the prompt alone), got "
                          f"{self.max_tokens}", "max_tokens")
        if self.max_tokens == 0 and not self.echo:
            raise invalid("max_tokens must be at least 1, got 0 (0 asks for the prompt alone, "
                          "which needs echo)", "max_tokens")

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Top-N of the prompt logprobs the engine computes: for echo with logprobs, and for
        prompt_logprobs (the larger when both)."""
        wanted = [n for n in (self.prompt_logprobs, self.logprobs if self.echo else None)
                  if n is not None]
        return max(wanted) if wanted else None

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


class ContentPart(RequestBody):
    type: Literal["text"]
    text: str


class ChatMessage(RequestBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = Field(None, description="assistant messages")
    tool_call_id: str | None = Field(None, description="tool messages: the call answered")

    def to_template(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        msg: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": content or ""}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            msg = template_messages_args({**msg, "tool_calls": self.tool_calls})
        return msg


# The chat template owns these arguments; chat_template_kwargs may not set them (a client's own
# "chat_template" would be a template of its choosing run on the server).
RESERVED_TEMPLATE_ARGS = frozenset({
    "conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message",
    "return_dict", "return_tensors", "chat_template", "tools", "documents", "tokenizer_kwargs",
    "return_assistant_tokens_mask", "padding", "truncation", "max_length"})


class ChatCompletionRequest(SamplingFields):
    # Not the schema's maxItems: that many messages outgrow the default body limit, so a
    # client sending them meets its 413 before the count's 400.
    messages: list[ChatMessage] = Field(min_length=1, description=f"at most {MAX_CHAT_MESSAGES}")
    max_completion_tokens: documented(int, type="integer", minimum=1, **{LIMIT_KEY: "max_tokens"}
                                ) | None = Field(None, description="takes precedence over "
                                                 "max_tokens")
    logprobs: bool | None = False
    top_logprobs: documented(int, type="integer", minimum=0, maximum=MAX_LOGPROBS) | None = Field(
        None, description="needs logprobs to be true")
    tools: list[dict[str, Any]] | None = Field(
        None, description="[{type: function, function: {name, description, parameters}}]",
        json_schema_extra={"maxItems": MAX_TOOLS})
    tool_choice: str | dict[str, Any] | None = Field(
        None, description="none, auto (a tool-call parser: the chat template's, or "
                          "--tool-call-parser), required, or "
                          "{type: function, function: {name}}")
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool | None = Field(True, description="not together with "
                                                                 "continue_final_message")
    continue_final_message: bool | None = False
    chat_template_kwargs: documented(dict[str, Any], type="object", propertyNames={
        "not": {"enum": sorted(RESERVED_TEMPLATE_ARGS)}}) | None = None

    def check(self) -> None:
        self.check_common()
        check_template_fields(self)
        if self.top_logprobs and not self.logprobs:
            raise invalid("top_logprobs needs logprobs to be true", "top_logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0


def check_template_fields(req: Any) -> None:
    """The chat template's inputs of a request (chat completions, /tokenize with messages):
    `messages`, `add_generation_prompt`, `continue_final_message`, `chat_template_kwargs`."""
    if len(req.messages) > MAX_CHAT_MESSAGES:
        raise invalid(f"messages has {len(req.messages)} entries but at most "
                      f"{MAX_CHAT_MESSAGES} are allowed", "messages")
    if req.add_generation_prompt and req.continue_final_message:
        raise invalid("add_generation_prompt and continue_final_message cannot both be true",
                      "continue_final_message")
    clash = RESERVED_TEMPLATE_ARGS & (req.chat_template_kwargs or {}).keys()
    if clash:
        raise invalid(f"chat_template_kwargs may not set {', '.join(sorted(clash))}",
                      "chat_template_kwargs")
