"""Wiring structured output into a scheduler and its service (both process and in-process)."""
from __future__ import annotations

from pagedserve.pipeline.structured.compiler import GrammarCompiler
from pagedserve.pipeline.structured.gate import GrammarGate
from pagedserve.pipeline.structured.matchers import GrammarBook


def enable_structured_outputs(scheduler, model_info, *, timeout_s: float = 30.0,
                              warm: bool = False) -> GrammarGate:
    """Give `scheduler` its GrammarBook; returns the gate its service holds requests in.
    `warm`: build the vocabulary's matcher tables now in a background thread (a serving
    scheduler does; the in-process engine waits for its first grammar)."""
    compiler = GrammarCompiler(model_info.tokenizer_dir, model_info.vocab_size,
                               list(model_info.eos_token_ids), timeout_s=timeout_s)
    if warm:
        compiler.warm()
    scheduler.grammar_book = GrammarBook(model_info.vocab_size, lambda: compiler.utf8_guard)
    return GrammarGate(compiler)
