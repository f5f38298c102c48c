"""workers.config_cache: a model's config read from the cache equals the one transformers'
config classes fill in, and a start that finds it never imports transformers."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from transformers import AutoConfig

from pagedserve.workers.config_cache import model_config_from_dict
from pagedserve.workers.model_config import ModelConfig
from test_model_families import FAMILIES


def fresh(raw: dict) -> ModelConfig:
    return ModelConfig.from_hf(AutoConfig.for_model(**raw))


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_a_cached_config_equals_the_one_transformers_fills_in(tmp_path, arch):
    model_type = "gemma3_text" if arch == "gemma3" else arch
    raw = {"model_type": model_type, **FAMILIES[arch]}
    first = model_config_from_dict(raw, tmp_path)
    [entry] = (tmp_path / "configs").iterdir()
    assert first == fresh(raw)
    assert model_config_from_dict(raw, tmp_path) == first  # read back from the entry
    assert list((tmp_path / "configs").iterdir()) == [entry]
    changed = {**raw, "rms_norm_eps": 1e-3}  # another dict: another entry
    assert model_config_from_dict(changed, tmp_path).rms_norm_eps == 1e-3
    assert len(list((tmp_path / "configs").iterdir())) == 2


def test_a_damaged_entry_is_computed_again_and_rewritten(tmp_path):
    raw = {"model_type": "llama", **FAMILIES["llama"]}
    model_config_from_dict(raw, tmp_path)
    [entry] = (tmp_path / "configs").iterdir()
    entry.write_text('{"architecture": "llama"}')  # a stale layout: fields missing
    assert model_config_from_dict(raw, tmp_path) == fresh(raw)
    assert json.loads(entry.read_text())["hidden_size"] == FAMILIES["llama"]["hidden_size"]


def test_a_bad_config_is_refused_and_not_cached(tmp_path):
    raw = {"model_type": "llama", **FAMILIES["llama"], "num_key_value_heads": 3}
    with pytest.raises(Exception, match="num_key_value_heads"):
        model_config_from_dict(raw, tmp_path)
    assert not (tmp_path / "configs").exists() or not list((tmp_path / "configs").iterdir())


def test_a_start_that_finds_the_entry_does_not_import_transformers(tmp_path):
    raw = {"model_type": "qwen2", **FAMILIES["qwen2"]}
    expected = model_config_from_dict(raw, tmp_path)
    code = textwrap.dedent(f"""
        import json, sys
        from pathlib import Path
        from pagedserve.workers.config_cache import model_config_from_dict
        config = model_config_from_dict(json.loads({json.dumps(json.dumps(raw))}),
                                        Path({str(tmp_path)!r}))
        print(json.dumps([config.hidden_size, config.layer_windows, "transformers" in sys.modules]))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    hidden, windows, imported = json.loads(out.strip().splitlines()[-1])
    assert (hidden, tuple(windows), imported) == (expected.hidden_size, expected.layer_windows,
                                                   False)
