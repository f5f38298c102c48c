"""The request fields that constrain output, read into one StructuredOutputs (or None).

OpenAI's `response_format` ({"type": "text" | "json_object" | "json_schema"}), vLLM's
`structured_outputs` extra body ({json | regex | choice | grammar | structural_tag |
json_object}) and its older `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar` names. At most one may be given. The spec is parsed here (a bad schema, regex
or grammar is a 400 naming the field and the problem) before any token is spent.
"""
from __future__ import annotations

import json
from typing import Any

from pagedserve.pipeline.ingress.errors import invalid
from pagedserve.pipeline.structured.spec import StructuredOutputs

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
_SO_KINDS = ("json", "regex", "choice", "grammar", "structural_tag", "json_object")


def structured_spec(body: Any) -> StructuredOutputs | None:
    """The spec `body` (a request model) asks for; raises a 400 APIError naming the field."""
    found: list[tuple[str, StructuredOutputs]] = []
    if body.response_format is not None:
        spec = _from_response_format(body.response_format)
        if spec is not None:
            found.append(("response_format", spec))
    if body.structured_outputs is not None:
        found.append(("structured_outputs", _from_structured_outputs(body.structured_outputs)))
    for field, kind in GUIDED_FIELDS.items():
        value = getattr(body, field, None)
        if value is not None:
            found.append((field, _build(field, kind, value)))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(f for f, _ in found)
        raise invalid(f"only one of response_format, structured_outputs and guided_* may "
                      f"constrain the output; got {names}", found[1][0])
    field, spec = found[0]
    try:
        return spec.check()
    except ValueError as exc:
        raise invalid(f"{field}: {exc}", field) from None


def _from_response_format(fmt: dict) -> StructuredOutputs | None:
    kind = fmt.get("type")
    if not fmt or kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "json_schema":
        wrapper = fmt.get("json_schema")
        if not isinstance(wrapper, dict):
            raise invalid("response_format json_schema needs a json_schema object with a "
                          "schema", "response_format")
        schema = wrapper.get("schema", {"type": "object"} if "schema" not in wrapper else None)
        return _build("response_format", "json", schema)
    raise invalid(f"response_format type must be text, json_object or json_schema, got "
                  f"{kind!r}", "response_format")


def _from_structured_outputs(so: dict) -> StructuredOutputs:
    given = {k: v for k, v in so.items() if v not in (None, False)}
    unknown = sorted(set(given) - set(_SO_KINDS))
    if unknown:
        raise invalid(f"structured_outputs has unknown field(s) {', '.join(unknown)}; it takes "
                      f"one of {', '.join(_SO_KINDS)}", "structured_outputs")
    if len(given) != 1:
        raise invalid(f"structured_outputs must set exactly one of {', '.join(_SO_KINDS)}, "
                      f"got {sorted(given) or 'none'}", "structured_outputs")
    (kind, value), = given.items()
    return _build("structured_outputs", kind, value)


def _build(field: str, kind: str, value: Any) -> StructuredOutputs:
    try:
        if kind == "json":
            return StructuredOutputs.from_json_schema(value)
        if kind == "json_object":
            return StructuredOutputs(json_object=True)
        if kind == "choice":
            if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
                raise ValueError("choice must be a list of strings")
            return StructuredOutputs(choice=list(value))
        if kind == "structural_tag" and not isinstance(value, str):
            value = json.dumps(value)
        if not isinstance(value, str):
            raise ValueError(f"{kind} must be a string, got {type(value).__name__}")
        return StructuredOutputs(**{kind: value})
    except ValueError as exc:
        raise invalid(f"{field}: {exc}", field) from None
