"""What a request constrains its output to, as carried on SamplingParams and the wire.

Exactly one of the fields is set. `check()` parses the spec with xgrammar (no tokenizer needed,
a few milliseconds) so that a bad schema, regex or grammar is a 400 naming the problem before
the request reaches the engine; the scheduler compiles it against the vocabulary later.
"""
from __future__ import annotations

import hashlib
import json
import re
from typing import Any

import msgspec

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
# The compile cost grows with the spec: a schema, regex or grammar (or all choices together) of
# at most this many characters, and at most MAX_CHOICES choices.
MAX_SPEC_CHARS = 200_000
MAX_CHOICES = 1024
# Nested arrays and objects of a JSON schema or structural tag, as of a request body: deeper,
# json.loads, jsonschema and xgrammar's converter recurse past their stacks.
MAX_SPEC_DEPTH = 64
_XGR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


class StructuredOutputs(msgspec.Struct, kw_only=True, omit_defaults=True, frozen=True):
    """vLLM's `structured_outputs` (and OpenAI's response_format), one field set."""

    json: str | None = None            # a JSON schema, as JSON text
    json_object: bool = False          # any JSON object
    regex: str | None = None
    choice: list[str] | None = None    # one of these strings exactly
    grammar: str | None = None         # EBNF / GBNF
    structural_tag: str | None = None  # xgrammar's structural tag, as JSON text
    # A thinking model (--reasoning-parser): the constraint applies to the answer only, from
    # the token after `think_end` on; `think_start` non-empty: only when the output opens with
    # it (else from the first token). Token ids of the tags.
    think_start: list[int] = []
    think_end: list[int] = []

    @classmethod
    def from_json_schema(cls, schema: Any) -> "StructuredOutputs":
        """A schema given as a dict (or JSON text), kept as compact JSON text. Keys keep their
        order: it is the order in which the output writes an object's properties."""
        if isinstance(schema, str):
            _check_depth("the JSON schema", schema)
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
        try:
            return cls(json=json.dumps(schema, separators=(",", ":"), ensure_ascii=False))
        except RecursionError:
            raise ValueError(_too_deep("the JSON schema", None)) from None

    @property
    def kind(self) -> str:
        set_kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError("structured output must set exactly one of "
                             f"{', '.join(KINDS)}; got {set_kinds or 'none'}")
        return set_kinds[0]

    def key(self) -> str:
        """A hash of the spec: equal specs share one compiled grammar."""
        return hashlib.sha256(msgspec.json.encode(self)).hexdigest()[:32]

    def choice_grammar(self) -> str:
        """The EBNF of a choice: one rule with each option a quoted literal."""
        return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice)

    def check_size(self) -> "StructuredOutputs":
        """Raise ValueError if the spec is over its limits (cheap: no parsing)."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "choice":
            if not isinstance(value, list) or not value \
                    or any(not isinstance(c, str) or not c for c in value):
                raise ValueError("structured output choice must be a non-empty list of "
                                 "non-empty strings")
            if len(value) > MAX_CHOICES:
                raise ValueError(f"structured output choice has {len(value)} choices but at "
                                 f"most {MAX_CHOICES} are allowed")
            size = sum(map(len, value))
        else:
            size = len(value) if isinstance(value, str) else 0
        if size > MAX_SPEC_CHARS:
            raise ValueError(f"structured output {kind} has {size} characters but at most "
                             f"{MAX_SPEC_CHARS} are allowed")
        if kind in ("json", "structural_tag") and isinstance(value, str):
            _check_depth(f"structured output {kind}", value)
        return self

    def check(self) -> "StructuredOutputs":
        """Raise ValueError naming the problem if the spec cannot be turned into a grammar."""
        kind = self.check_size().kind
        if kind == "json":
            _check_schema(json.loads(self.json))
        try:
            parse_grammar(self)
        except RuntimeError as exc:
            raise ValueError(f"structured output {kind} does not compile: {xgrammar_message(exc)}") from None
        return self


def parse_grammar(spec: StructuredOutputs):
    """The spec as an xgrammar Grammar (tokenizer-independent)."""
    import xgrammar as xgr
    kind = spec.kind
    if kind == "json":
        return _json_control_chars_escaped(xgr.Grammar.from_json_schema(spec.json, any_whitespace=False))
    if kind == "json_object":
        return xgr.Grammar.builtin_json_grammar()
    if kind == "regex":
        return xgr.Grammar.from_regex(spec.regex)
    if kind == "choice":
        return xgr.Grammar.from_ebnf(spec.choice_grammar())
    if kind == "grammar":
        return xgr.Grammar.from_ebnf(spec.grammar)
    return xgr.Grammar.from_structural_tag(spec.structural_tag)


# xgrammar (0.2.9) writes a length-bounded string's characters as [^"\\\r\n], which admits
# raw control characters; JSON requires them escaped (json.loads refuses them). Its other
# strings exclude \0-\x1f already: the bounded ones are rewritten to match.
_LAX_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'


def _json_control_chars_escaped(grammar):
    import xgrammar as xgr
    text = str(grammar)
    fixed = text.replace(_LAX_STRING_CHAR, _JSON_STRING_CHAR)
    if fixed == text:
        return grammar
    try:
        return xgr.Grammar.from_ebnf(fixed)
    except RuntimeError:  # a form the printer writes but the parser does not read: keep it
        return grammar


def xgrammar_message(exc: BaseException) -> str:
    """xgrammar's error without its timestamp and C++ source location."""
    return _XGR_PREFIX.sub("", str(exc).strip())


def _check_schema(schema: Any) -> None:
    import jsonschema
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path) or "the top level"
        raise ValueError(f"invalid JSON schema at {where}: {exc.message}") from None


def _check_depth(what: str, text: str) -> None:
    """Refuse JSON text nested deeper than MAX_SPEC_DEPTH (text that is not JSON passes: its
    parser says so)."""
    if text.count("[") + text.count("{") <= MAX_SPEC_DEPTH:
        return
    try:
        depth = _json_depth(json.loads(text))
    except RecursionError:
        raise ValueError(_too_deep(what, None)) from None
    except ValueError:
        return
    if depth > MAX_SPEC_DEPTH:
        raise ValueError(_too_deep(what, depth))


def _json_depth(value: Any) -> int:
    deepest, stack = 0, [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def _too_deep(what: str, depth: int | None) -> str:
    shown = f"{depth} levels" if depth is not None else "deeper than a JSON parser allows"
    return (f"{what} nests arrays and objects {shown}{' deep' if depth else ''}; at most "
            f"{MAX_SPEC_DEPTH} levels are allowed")
