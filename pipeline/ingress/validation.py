"""Turn a raw HTTP body into a checked request: every failure is an APIError, never a 500.

Cheap checks run before tokenization (JSON shape, types, ranges, model name); the context
length checks need the token count and run after it.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from pagedserve.pipeline.ingress import limits
from pagedserve.pipeline.ingress.errors import APIError, invalid
from pagedserve.pipeline.ingress.json_body import decode_json_object
from pagedserve.pipeline.sampling_params import SamplingParams

M = TypeVar("M", bound=BaseModel)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

# Union-typed fields make pydantic report one error per branch; say what is accepted instead.
_UNION_HINTS = {
    "prompt": "must be a string, a list of strings, a list of token ids or a list of lists of "
              "token ids",
    "stop": "must be a string or a list of strings",
    "content": "must be a string or a list of {\"type\": \"text\", \"text\": ...} parts",
}


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than the limit of {limit} bytes",
                    code="request_too_large")


async def read_json_object(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object, refusing more than `limit` bytes before reading them all, and
    a body that takes longer than limits.BODY_TIMEOUT_S to arrive (a client trickling it)."""
    return decode_json_object(await read_body(request, limit))


async def read_body(request: Request, limit: int) -> bytes:
    """The body's bytes, bounded as read_json_object says."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    try:
        raw = await asyncio.wait_for(_read_body(request, limit), limits.BODY_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {limits.BODY_TIMEOUT_S:g} s",
                       code="request_timeout", headers={"Connection": "close"}) from None
    return raw


async def _read_body(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(400, "the client disconnected while sending the body") from None
    return b"".join(chunks)


def parse_request(model: type[M], body: dict[str, Any]) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _from_pydantic(exc) from None


def _from_pydantic(exc: ValidationError) -> APIError:
    err = exc.errors(include_url=False)[0]
    # Drop union branch labels such as 'list[int]' from the location.
    loc = [str(p) for p in err["loc"] if isinstance(p, int) or "[" not in str(p)]
    loc = [p for p in loc if p not in ("str", "int", "function-after")]
    param = ".".join(loc) or None
    field = loc[-1] if loc else ""
    if err["type"] == "missing":
        return invalid(f"'{param}' is a required field", param)
    hint = _UNION_HINTS.get(field) if len(exc.errors()) > 1 else None
    message = hint or err["msg"][:1].lower() + err["msg"][1:]
    if "input" in err and not hint and err["type"] not in ("too_short",):
        message += f", got {_short(err['input'])}"
    return invalid(f"{param}: {message}" if param else message, param)


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, BaseModel) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_model_name(requested: str | None, served: list[str]) -> None:
    if requested is not None and requested not in served:
        raise APIError(404, f"The model '{requested}' does not exist; this server serves "
                            f"{', '.join(repr(s) for s in served)}.", param="model",
                       code="model_not_found")


def validated_params(params_factory, *, vocab_size: int, max_n: int,
                     param_names: dict[str, str] | None = None) -> SamplingParams:
    """Build and range-check SamplingParams; a bad field becomes a 400 naming it. (A
    structured-output spec was parsed when the request's fields were read: structured_fields.)"""
    try:
        params: SamplingParams = params_factory()
        return params.validate(vocab_size=vocab_size, max_n=max_n, check_structured=False)
    except (ValueError, TypeError) as exc:
        message = str(exc)
        field = message.split(" ", 1)[0].split("[", 1)[0]  # "stop[3] has ..." names stop
        param = (param_names or {}).get(field, field)
        if param != field:
            message = param + message[len(field):]
        raise invalid(message, param) from None


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    for t in ids:
        if not 0 <= t < vocab_size:
            raise invalid(f"{param} contains token id {t}, outside the vocabulary "
                          f"[0, {vocab_size})", param)


def resolve_max_tokens(num_prompt_tokens: int, requested: int | None, *, default: int | None,
                       max_model_len: int, prompt_param: str, max_tokens_param: str) -> int:
    """How many tokens the request may generate; refuses what cannot fit the context."""
    if num_prompt_tokens >= max_model_len:
        raise invalid(f"This model's maximum context length is {max_model_len} tokens. However, "
                      f"your request has {num_prompt_tokens} input tokens, which leaves no room "
                      "for a completion. Please reduce the length of the input.", prompt_param,
                      code="context_length_exceeded")
    room = max_model_len - num_prompt_tokens
    if requested is None:
        return room if default is None else min(default, room)
    if num_prompt_tokens + requested > max_model_len:
        raise invalid(f"This model's maximum context length is {max_model_len} tokens. However, "
                      f"you requested {num_prompt_tokens + requested} tokens "
                      f"({num_prompt_tokens} in the input, {requested} in the completion). "
                      "Please reduce the length of the input or the completion.",
                      max_tokens_param, code="context_length_exceeded")
    return requested
