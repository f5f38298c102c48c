"""How a model pools: --pooler-config over its sentence-transformers files over its kind's
default; and the checks on the flag and on an encoder's context."""
import json

import pytest

from pagedserve.pipeline.config import EngineConfig
from pagedserve.pipeline.load_error import ModelLoadError
from pagedserve.pipeline.pooling import PoolerConfig, PoolingParams, truncate


def write_st(path, pooling, normalize=True):
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_cls_token": pooling == "cls",
         "pooling_mode_lasttoken": pooling == "last"}))
    return path


def test_the_model_files_then_the_flag_decide(tmp_path):
    assert PoolerConfig.for_model(tmp_path, encoder=False) == PoolerConfig("LAST", True)
    assert PoolerConfig.for_model(tmp_path, encoder=True) == PoolerConfig("CLS", True)
    write_st(tmp_path, "mean", normalize=False)
    found = PoolerConfig.for_model(tmp_path, encoder=True)
    assert found == PoolerConfig("MEAN", False) and found.whole_prompt
    assert PoolerConfig.parse('{"normalize": true}', found) == PoolerConfig("MEAN", True)
    assert PoolerConfig.parse('{"pooling_type": "last"}', found) == PoolerConfig("LAST", False)
    assert not PoolerConfig("LAST").whole_prompt


def test_bad_pooler_configs_are_refused_naming_the_field(tmp_path):
    with pytest.raises(ValueError, match="pooling_type must be one of LAST, MEAN, CLS, got 'MAX'"):
        PoolerConfig.parse('{"pooling_type": "max"}', PoolerConfig())
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['dims'\]"):
        PoolerConfig.parse('{"dims": 3}', PoolerConfig())
    with pytest.raises(ValueError, match="--pooler-config"):
        EngineConfig.from_kwargs(pooler_config="{not json")
    (tmp_path / "modules.json").write_text(json.dumps(
        [{"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text('{"pooling_mode_max_tokens": true}')
    with pytest.raises(ValueError, match="no pooling mode we support"):
        PoolerConfig.for_model(tmp_path, encoder=True)


def test_dimensions_and_truncation():
    import numpy as np
    with pytest.raises(ValueError, match="from 1 to the model's hidden size 4, got 5"):
        PoolingParams(dimensions=5).validate(4)
    v = np.array([0.6, 0.8, 0.0, 0.0], np.float32)
    assert np.allclose(truncate(v, 1), [1.0]) and truncate(v, None) is v


def test_an_encoder_refuses_a_context_past_its_positions(tmp_path, monkeypatch):
    from transformers import BertConfig, BertModel
    from pagedserve.pipeline.model_resolution import resolve_model
    BertModel(BertConfig(vocab_size=50, hidden_size=8, num_hidden_layers=1,
                         num_attention_heads=2, intermediate_size=16,
                         max_position_embeddings=32)).save_pretrained(tmp_path)
    write_st(tmp_path, "mean")
    config = EngineConfig.from_kwargs(model=str(tmp_path), max_model_len=64)
    with pytest.raises(ModelLoadError, match="--max-model-len 64 is longer than the 32 positions"):
        resolve_model(config)
    config = EngineConfig.from_kwargs(model=str(tmp_path))
    resolve_model(config)
    info = config.model_info
    assert info.is_encoder and info.hidden_size == 8 and info.pooler() == PoolerConfig("MEAN")
    assert not config.cache.enable_prefix_caching  # an encoder's KV is never reused
