"""Loading a model's tokenizer (the fast tokenizer with its chat template). The ingress, the
detokenizer and the offline API load it from the directory the launcher resolved
(`EngineConfig.model_info.tokenizer_dir`)."""
from __future__ import annotations

import logging
from pathlib import Path

from pagedserve.workers.load_error import ModelLoadError

logger = logging.getLogger("pagedserve.tokenizer")


def load_tokenizer(model_dir: str | Path):
    """The fast tokenizer of model_dir, with its chat template when the model has one."""
    model_dir = Path(model_dir)
    if not any((model_dir / n).is_file() for n in ("tokenizer.json", "tokenizer.model")):
        raise ModelLoadError(f"{model_dir}: no tokenizer files (tokenizer.json or tokenizer.model)")
    try:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except Exception as e:
        raise ModelLoadError(f"{model_dir}: the tokenizer could not be loaded "
                             f"({type(e).__name__}: {e})") from e
    if not getattr(tokenizer, "is_fast", False):
        raise ModelLoadError(f"{model_dir}: only fast (tokenizer.json) tokenizers are supported")
    if not tokenizer.chat_template:
        logger.info("%s: the tokenizer has no chat template", model_dir)
    return tokenizer
