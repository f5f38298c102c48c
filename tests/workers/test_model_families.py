"""Every family of workers/models/ against transformers' own model class, token for token.

Tiny random checkpoints (workers.testing.make_tiny_model) greedy-decode 48 tokens in fp32
through WorkerCore with real StepPlans: prompts in chunks of 5, shuffled block tables, decode
columns. Windows are shorter than the prompts, so the window decides which keys a row sees.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve.workers.loader import ModelLoadError, iter_weights, load_config
from pagedserve.workers.models import REGISTRY, model_class
from pagedserve.workers.model_config import ENCODERS, SUPPORTED, ModelConfig
from pagedserve.workers.testing import hf_greedy, make_tiny_model
from pagedserve.workers.tp_launch import RankSpec, TPWorkers
from test_worker_core import make_core, run_greedy

SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)
GEMMA3 = {**SMALL, "num_hidden_layers": 4, "hidden_size": 56, "num_attention_heads": 7,
          "num_key_value_heads": 1,
          "head_dim": 256, "query_pre_attn_scalar": 64, "sliding_window": 11,
          "layer_types": ["sliding_attention", "full_attention"] * 2,
          "final_logit_softcapping": 8.0, "tie_word_embeddings": False,
          "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                              "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                 "rope_theta": 10000.0}}}
FAMILIES = {
    "llama": SMALL,
    "mistral": {**SMALL, "head_dim": 16, "sliding_window": 13},
    "qwen2": {**SMALL, "use_sliding_window": True, "sliding_window": 9, "max_window_layers": 1},
    "qwen3": {**SMALL, "head_dim": 16},
    "gemma3": GEMMA3,
    "glm4": {**SMALL, "head_dim": 16, "num_key_value_heads": 1,
             "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                 "partial_rotary_factor": 0.5}},
}
SEEDS = {"gemma3": 2}


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models on one thread: a second one only adds OpenMP's spinning on a shared box."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {arch: make_tiny_model(root / arch, arch, seed=SEEDS.get(arch, 1), **config)
            for arch, config in FAMILIES.items()}


def prompts(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 512, n).tolist() for n in (31, 4)]


def test_registry_covers_every_supported_architecture():
    # the decoders here; the encoders (BERT) in test_pooling_models.py
    assert sorted(REGISTRY) == sorted(SUPPORTED) == sorted([*FAMILIES, *ENCODERS])
    with pytest.raises(ValueError, match="'gpt2' is not supported.*gemma3, glm4, llama"):
        model_class("gpt2")


def test_configs_read_each_familys_features(model_dirs):
    gemma = load_config(model_dirs["gemma3"])
    assert gemma.layer_windows == (11, 0, 11, 0) and gemma.sliding_window == 0
    assert gemma.layer_rope_thetas == (100.0, 10000.0, 100.0, 10000.0)
    assert gemma.layer_rope_scalings[::2] == (None, None)
    assert gemma.layer_rope_scalings[1] == {"rope_type": "linear", "factor": 2.0}
    assert (gemma.hidden_act, gemma.qk_norm, gemma.attention_scale,
            gemma.final_logit_softcapping) == ("gelu_tanh", True, 64 ** -0.5, 8.0)
    mistral = load_config(model_dirs["mistral"])
    assert mistral.layer_windows == (13, 13) and mistral.sliding_window == 13
    qwen2 = load_config(model_dirs["qwen2"])
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.layer_windows) == (True, False, (0, 9))
    qwen3 = load_config(model_dirs["qwen3"])
    assert (qwen3.qk_norm, qwen3.qkv_bias, qwen3.sliding_window) == (True, False, 0)
    glm = load_config(model_dirs["glm4"])
    assert (glm.rotary_dim, glm.rope_interleaved, glm.qkv_bias) == (8, True, True)


def test_gemma3_with_a_vision_tower_serves_its_text_model():
    from transformers import AutoConfig
    text = {k: v for k, v in GEMMA3.items() if k not in ("bos_token_id", "eos_token_id")}
    outer = AutoConfig.for_model("gemma3", text_config=text, eos_token_id=[1, 106])
    config = ModelConfig.from_hf(outer)
    assert (config.architecture, config.num_hidden_layers, config.head_dim) == ("gemma3", 4, 256)
    assert config.layer_windows == (11, 0, 11, 0) and config.eos_token_ids == (1, 106)
    model = model_class("gemma3")(config)
    assert model.checkpoint_name("model.language_model.layers.0.mlp.up_proj.weight") == \
        "model.layers.0.mlp.up_proj.weight"
    assert model.checkpoint_name("model.vision_tower.vision_model.post_layernorm.weight") is None


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_greedy_equals_transformers(model_dirs, arch):
    check_greedy(model_dirs[arch], prompts(seed=len(arch)))


def test_qwen3_with_attention_bias_equals_transformers(tmp_path):
    # attention_bias puts a bias on q/k/v and on o_proj (added after the all-reduce)
    model_dir = make_tiny_model(tmp_path / "qwen3", "qwen3", seed=2,
                                **{**FAMILIES["qwen3"], "attention_bias": True})
    config = load_config(model_dir)
    assert config.qkv_bias and config.o_bias
    check_greedy(model_dir, prompts(seed=5))


def check_greedy(model_dir, batch):
    expected = hf_greedy(model_dir, batch, 48)
    assert expected[0] != expected[1] and min(len(set(ids)) for ids in expected) > 8
    ours = run_greedy(make_core(model_dir, num_blocks=48).execute, batch, 48, chunk=5,
                      num_blocks=48, seed=3, columns=True)
    assert ours == expected


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_tp2_equals_tp1(model_dirs, arch):
    # qwen2: 2 kv heads, one a rank; gemma3: 7 q heads over 1 kv head, split 4 / 3 with the kv
    # head held by both ranks
    batch = prompts(seed=7)
    tp1 = run_greedy(make_core(model_dirs[arch], num_blocks=48).execute, batch, 12, chunk=9,
                     num_blocks=48)
    with TPWorkers(RankSpec(str(model_dirs[arch]), num_blocks=48), tp_size=2,
                   timeout_s=120) as workers:
        assert run_greedy(workers.execute, batch, 12, chunk=9, num_blocks=48) == tp1


def _rewrite(model_dir, tmp_path, change) -> object:
    """A copy of model_dir whose tensors are change(dict of tensors)."""
    out = tmp_path / "changed"
    out.mkdir()
    (out / "config.json").write_text((model_dir / "config.json").read_text())
    tensors = load_file(model_dir / "model.safetensors")
    save_file(change(dict(tensors)), out / "model.safetensors")
    return out


def test_missing_and_misshapen_tensors_are_named(model_dirs, tmp_path):
    glm = model_dirs["glm4"]
    config = load_config(glm)
    model = model_class("glm4")(config)
    name = "model.layers.1.post_mlp_layernorm.weight"
    with pytest.raises(ValueError, match=f"missing 1 tensors.*{name}"):
        model.load_weights((n, t) for n, t in iter_weights(glm) if n != name)
    bias = "model.layers.0.self_attn.k_proj.bias"
    with pytest.raises(ValueError, match=rf"weight '{bias}': k_proj.bias: expected shape \(16,\), "
                                         rf"got \(15,\)"):
        model.load_weights((n, t[:15] if n == bias else t) for n, t in iter_weights(glm))
    up = "model.layers.0.mlp.up_proj.weight"
    broken = _rewrite(model_dirs["qwen2"], tmp_path,
                      lambda ts: {**ts, up: ts[up][:, :8].contiguous()})
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.up_proj.weight'.*expected shape "
                                         r"\(96, 64\), got \(96, 8\)"):
        make_core(broken)


def test_unknown_architecture_is_refused_naming_it(model_dirs, tmp_path):
    config = json.loads((model_dirs["llama"] / "config.json").read_text())
    config.update(model_type="phi3", architectures=["Phi3ForCausalLM"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"unsupported architecture model_type='phi3' "
                                             r"\(architectures \['Phi3ForCausalLM'\]\); supported: "
                                             r"bert, gemma3, glm4, llama, mistral, qwen2, qwen3"):
        load_config(tmp_path)
