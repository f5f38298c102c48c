"""What the served model can do, as `/v1/models` reports it (Ollama's capability names, plus
this server's): read once from the tokenizer and the ingress's settings."""
from __future__ import annotations

from typing import Any

from pagedserve.pipeline.ingress.fim import fim_tokens


def model_capabilities(tokenizer: Any, tool_call_parser: str | None,
                       reasoning_parser: str | None, *, encoder: bool = False) -> list[str]:
    """`embedding` always (/v1/embeddings pools any model); an encoder (BERT) nothing else.
    A decoder: `completion` always; `chat` with a chat template; `tools` when tool_choice auto
    reads calls (a parser, from --tool-call-parser or the template); `insert` with
    fill-in-the-middle tokens (suffix, /infill); `thinking` with --reasoning-parser;
    `json_schema` always (response_format and guided decoding)."""
    if encoder:
        return ["embedding"]
    found = ["completion"]
    if getattr(tokenizer, "chat_template", None):
        found.append("chat")
        if tool_call_parser is not None:
            found.append("tools")
    if fim_tokens(tokenizer) is not None:
        found.append("insert")
    if reasoning_parser is not None:
        found.append("thinking")
    found += ["json_schema", "embedding"]
    return found
