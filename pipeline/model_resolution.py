"""What the launcher serves: the model fetched or converted once, before any role starts, and
what every role needs to know about it (`config.model_info`). The offline API, the engine group
and the launcher call `resolve_model`; the children only read the cache it fills."""
from __future__ import annotations

import logging
import os

from pagedserve.pipeline.config import EngineConfig, ModelInfo

log = logging.getLogger("pagedserve.launcher")


def resolve_model(config: EngineConfig) -> None:
    """Fetch or convert the model once, here, and record what every role needs to know about
    it in `config.model_info`: the children only read the cache, and none of them imports the
    loader. Raises ModelLoadError naming the problem."""
    from pagedserve.pipeline.generation_defaults import describe, read_generation_defaults
    from pagedserve.pipeline.tokenizer import read_chat_template
    from pagedserve.workers.loader import load_config, resolve_model as resolve
    model_dir = str(resolve(config.model.model, config.env.cache_root))
    model = load_config(model_dir)
    defaults, source = read_generation_defaults(config.model.generation_config, model_dir)
    log.info("%s", describe(defaults, source))
    if config.model.served_model_name is None:
        config.model.served_model_name = os.path.basename(config.model.model.rstrip("/"))
    config.model.model = model_dir
    config.model_info = ModelInfo(
        model_dir=model_dir, tokenizer_dir=model_dir, architecture=model.architecture,
        vocab_size=model.vocab_size, max_position_embeddings=model.max_position_embeddings,
        eos_token_ids=list(model.eos_token_ids), bos_token_id=model.bos_token_id,
        generation_defaults=defaults, chat_template=read_chat_template(config.model.chat_template),
        sliding_window=getattr(model, "sliding_window", 0) or 0, hidden_size=model.hidden_size,
        is_encoder=model.is_encoder, pooling=_pooler(config.model.pooler_config, model_dir,
                                                     model.is_encoder).to_dict())
    if model.is_encoder and (config.model.max_model_len or 0) > model.max_position_embeddings:
        from pagedserve.pipeline.load_error import ModelLoadError
        raise ModelLoadError(f"--max-model-len {config.model.max_model_len} is longer than the "
                             f"{model.max_position_embeddings} positions this encoder has")
    if model.is_encoder and config.cache.enable_prefix_caching:
        config.cache.enable_prefix_caching = False  # its KV is never reused (bidirectional)
        log.info("prefix caching off: %s is an encoder", model.architecture)


def _pooler(flag: str | None, model_dir: str, encoder: bool):
    """--pooler-config over the model's sentence-transformers pooling (or its kind's default)."""
    from pagedserve.pipeline.load_error import ModelLoadError
    from pagedserve.pipeline.pooling import PoolerConfig
    try:
        pooler = PoolerConfig.parse(flag, PoolerConfig.for_model(model_dir, encoder))
    except ValueError as exc:
        raise ModelLoadError(f"pooling: {exc}") from None
    log.info("embeddings: %s pooling%s", pooler.pooling_type,
             ", normalized" if pooler.normalize else "")
    return pooler
