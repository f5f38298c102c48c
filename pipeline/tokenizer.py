"""Loading a model's tokenizer (the fast tokenizer with its chat template). The ingress, the
detokenizer and the offline API load it from the directory the launcher resolved
(`EngineConfig.model_info.tokenizer_dir`), with `--chat-template` in place of the tokenizer's
own template when given (`model_info.chat_template`, read once by the launcher)."""
from __future__ import annotations

import logging
from pathlib import Path

from pagedserve.pipeline.load_error import ModelLoadError

logger = logging.getLogger("pagedserve.tokenizer")


def read_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text, or the value itself when it is an inline template (vLLM's
    rule: a value holding Jinja markup is a template, anything else must be a readable file)."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if any(mark in value for mark in ("{{", "{%")) and not _is_file(path):
        return value
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"--chat-template {value!r}: neither a readable file nor an inline "
                             f"Jinja template ({e})") from e


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # e.g. a long inline template is no valid file name
        return False


def load_tokenizer(model_dir: str | Path, *, chat_template: str | None = None):
    """The fast tokenizer of model_dir, with its chat template when the model has one, or
    `chat_template` instead when given."""
    model_dir = Path(model_dir)
    if not any((model_dir / n).is_file() for n in ("tokenizer.json", "tokenizer.model")):
        raise ModelLoadError(f"{model_dir}: no tokenizer files (tokenizer.json or tokenizer.model)")
    try:
        tokenizer = _from_pretrained(model_dir)
    except Exception as e:
        raise ModelLoadError(f"{model_dir}: the tokenizer could not be loaded "
                             f"({type(e).__name__}: {e})") from e
    if not getattr(tokenizer, "is_fast", False):
        raise ModelLoadError(f"{model_dir}: only fast (tokenizer.json) tokenizers are supported")
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    if not tokenizer.chat_template:
        logger.info("%s: the tokenizer has no chat template", model_dir)
    return tokenizer


def _from_pretrained(model_dir: Path):
    """AutoTokenizer's choice for this directory, remembered: AutoTokenizer reads the model's
    config through transformers' config classes to pick the tokenizer class, which imports
    torch (seconds of every start of the ingress); the class it picked, recorded in
    `<cache>/tokenizer-classes/` by the directory's files, loads the same tokenizer directly."""
    import json

    import transformers

    from pagedserve import envs
    from pagedserve.cache_files import (TOKENIZER_FILES, cache_key, package_version,
                                       read_cached, write_text_atomic)
    key = cache_key(package_version("transformers"),
                    files=(model_dir / name for name in (*TOKENIZER_FILES, "config.json")))
    path = envs.current().cache_root / "tokenizer-classes" / f"{key}.json"
    recorded = read_cached(
        path, lambda text: getattr(transformers, json.loads(text)["class"]).from_pretrained(
            model_dir), logger, (OSError, ValueError, KeyError, TypeError, AttributeError))
    if recorded is not None:
        return recorded
    # not recorded yet (or damaged): ask AutoTokenizer and record its choice
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    name = type(tokenizer).__name__
    if getattr(transformers, name, None) is type(tokenizer):
        write_text_atomic(path, json.dumps({"class": name}), logger)
    return tokenizer
