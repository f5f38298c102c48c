"""ModelConfig from a config.json dict, with transformers' class defaults filled in, cached.

transformers fills the fields a config.json leaves out from its config class (Llama's,
Qwen2's, ...), but importing it costs seconds (it imports torch), and every engine start, the
launcher's before any role starts, reads the config. So the result is kept in
`<cache>/configs/`, keyed by the dict and the transformers version that filled it: a later
start reads one small JSON file. A missing, unreadable or stale entry is computed again.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from pagedserve.cache_files import cache_key, package_version, read_cached, write_text_atomic
from pagedserve.pipeline.load_error import ModelLoadError
from pagedserve.workers.model_config import ARCHITECTURES, ModelConfig

log = logging.getLogger(__name__)

_TUPLES = ("eos_token_ids", "layer_windows", "layer_rope_thetas", "layer_rope_scalings")


def model_config_from_dict(raw: dict, cache_root: Path | None) -> ModelConfig:
    """`raw`: config.json's object. Raises what ModelConfig.from_hf raises for a bad one."""
    path = _entry(raw, cache_root) if cache_root is not None else None
    if path is not None:
        cached = read_cached(path, _parse, log, (OSError, ValueError, KeyError, TypeError,
                                                 ModelLoadError))
        if cached is not None:
            return cached
    from transformers import AutoConfig
    hf_config = AutoConfig.for_model(**raw) if raw.get("model_type") in ARCHITECTURES else raw
    config = ModelConfig.from_hf(hf_config)
    if path is not None:
        write_text_atomic(path, json.dumps(dataclasses.asdict(config)), log)
    return config


def _entry(raw: dict, cache_root: Path) -> Path:
    key = cache_key(package_version("transformers"), json.dumps(raw, sort_keys=True, default=str))
    return Path(cache_root) / "configs" / f"{key}.json"


def _parse(text: str) -> ModelConfig:
    fields = json.loads(text)
    for name in _TUPLES:
        fields[name] = tuple(fields[name])
    return ModelConfig(**fields)
