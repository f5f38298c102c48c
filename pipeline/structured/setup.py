"""Wiring structured output into a scheduler and its service (both process and in-process)."""
from __future__ import annotations

from pagedserve.pipeline.structured.compiler import GrammarCompiler
from pagedserve.pipeline.structured.gate import GrammarGate
from pagedserve.pipeline.structured.matchers import GrammarBook


def enable_structured_outputs(scheduler, model_info, *, timeout_s: float = 30.0) -> GrammarGate:
    """Give `scheduler` its GrammarBook; returns the gate its service holds requests in. The
    vocabulary's matcher tables are built by the first grammar, or ahead of it by
    `gate.compiler.warm()` (a serving scheduler calls it once idle)."""
    compiler = GrammarCompiler(model_info.tokenizer_dir, model_info.vocab_size,
                               list(model_info.eos_token_ids), timeout_s=timeout_s)
    scheduler.grammar_book = GrammarBook(model_info.vocab_size, lambda: compiler.utf8_guard)
    return GrammarGate(compiler)
