"""What the router reads of a request body without a tokenizer: the model, the prompt's
leading text (the affinity key) and an estimate of the tokens it costs."""
from __future__ import annotations

from typing import Any

from pagedserve.pipeline.router.affinity import CHARS_PER_TOKEN

DEFAULT_GENERATION_ESTIMATE = 256  # tokens charged for a request that names no max_tokens


def _content(message: Any) -> str:
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


# Routes that generate nothing, charged their input only: /tokenize and /detokenize (vLLM's),
# /v1/embeddings.
NON_GENERATING = frozenset({"tokenize", "detokenize", "embeddings"})


def _as_prompt(kind: str, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """/v1/embeddings' `input` has the shapes of a completion's `prompt`: read it as one."""
    return ("completion", {"prompt": body.get("input")}) if kind == "embeddings" else (kind, body)


def _is_chat(kind: str, body: dict[str, Any]) -> bool:
    return kind in ("chat", "messages") or (kind == "tokenize" and body.get("messages") is not None)


def _system(kind: str, body: dict[str, Any]) -> str:
    """/v1/messages (Anthropic's) keeps the system prompt apart: a string or text blocks."""
    return _content({"content": body.get("system")}) if kind == "messages" else ""


def _responses_as_chat(body: dict[str, Any]) -> dict[str, Any]:
    """/v1/responses (OpenAI's): instructions and input items as chat messages."""
    given = body.get("input")
    items = [{"role": "user", "content": given}] if isinstance(given, str) else \
        [i for i in given if isinstance(i, dict)] if isinstance(given, list) else []
    instructions = body.get("instructions")
    system = [{"role": "system", "content": instructions}] if isinstance(instructions, str) else []
    return {"messages": system + [{"role": i.get("role", "tool"),
                                   "content": i.get("content", i.get("output", ""))}
                                  for i in items]}


def _infill_text(body: dict[str, Any]) -> str:
    """/infill's text in the order the FIM prompt puts it: the extra files, then the prefix
    (the suffix and the middle after them)."""
    extra = body.get("input_extra")
    parts = [e.get("text") for e in extra if isinstance(e, dict)] if isinstance(extra, list) else []
    parts.append(body.get("input_prefix"))
    return "".join(p for p in parts if isinstance(p, str))


def affinity_prompt(kind: str, body: dict[str, Any]) -> str | list[int]:
    """The part of the prompt a conversation keeps from turn to turn: for chat, the messages up
    to and including the first user message (later turns only append); for a completion, the
    prompt (its first one for a batch); for /infill, the context before the gap."""
    kind, body = _as_prompt(kind, body)
    if kind == "responses":
        kind, body = "chat", _responses_as_chat(body)
    if kind == "infill":
        return _infill_text(body)
    if kind == "detokenize":
        tokens = body.get("tokens")
        return tokens if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens) \
            else ""
    if _is_chat(kind, body):
        parts = [f"system\x00{_system(kind, body)}\x00"] if kind == "messages" else []
        for message in body.get("messages") or ():
            role = message.get("role", "") if isinstance(message, dict) else ""
            parts.append(f"{role}\x00{_content(message)}\x00")
            if role == "user":
                break
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return prompt
    return prompt if isinstance(prompt, str) else ""


def estimate_prompt_tokens(kind: str, body: dict[str, Any]) -> int:
    """The prompt's tokens, from its length (token ids: their count)."""
    kind, body = _as_prompt(kind, body)
    if kind == "responses":
        kind, body = "chat", _responses_as_chat(body)
    if kind == "infill":
        tail = [body.get(k) for k in ("input_suffix", "prompt")]
        return (len(_infill_text(body)) + sum(len(t) for t in tail if isinstance(t, str))) \
            // CHARS_PER_TOKEN
    if kind == "detokenize":
        tokens = body.get("tokens")
        return len(tokens) if isinstance(tokens, list) else 0
    if _is_chat(kind, body):
        return len(_system(kind, body)) // CHARS_PER_TOKEN + \
            sum(len(_content(m)) // CHARS_PER_TOKEN + 4 for m in body.get("messages") or ())
    p = body.get("prompt")
    items = p if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
    return sum(len(x) if isinstance(x, list) else len(x or "") // CHARS_PER_TOKEN
               for x in items if isinstance(x, (str, list)))


def estimate_generation(body: dict[str, Any], kind: str = "") -> int:
    """The most the request may generate: max_tokens per sample (llama.cpp's n_predict), or a
    reservation of DEFAULT_GENERATION_ESTIMATE when it names none (the charge is settled with
    what it used); nothing for a route that generates nothing."""
    if kind in NON_GENERATING:
        return 0
    most = body.get("max_completion_tokens") or body.get("max_tokens") or \
        body.get("max_output_tokens")  # /v1/responses
    if most is None and isinstance(body.get("n_predict"), int) and body["n_predict"] > 0:
        most = body["n_predict"]
    n = body.get("n") or 1
    return (most if isinstance(most, int) else DEFAULT_GENERATION_ESTIMATE) * \
        (n if isinstance(n, int) else 1)


def estimate_tokens(kind: str, body: dict[str, Any]) -> int:
    """Prompt tokens (from its length) plus the most it may generate, for load and limits."""
    return max(1, estimate_prompt_tokens(kind, body) + estimate_generation(body, kind))
