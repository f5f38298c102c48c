"""Test helpers: tiny random-weight model directories, and transformers' own greedy decode."""
from __future__ import annotations

import functools
from collections.abc import Iterable
from pathlib import Path


def make_tiny_llama(path: str | Path, *, seed: int = 0, num_layers: int = 2,
                    hidden_size: int = 64, num_heads: int = 4, num_kv_heads: int = 2,
                    intermediate_size: int = 128, vocab_size: int = 512, tie: bool = True,
                    max_pos: int = 2048) -> Path:
    """Write a seeded random-weight HF Llama directory (config.json + model.safetensors).

    Weights are drawn with std 0.3 rather than the usual 0.02: with small weights a tied model
    just repeats a token, while 0.3 gives varied greedy continuations with clear argmax margins,
    so engine-vs-reference comparisons are sensitive yet do not hinge on fp32 rounding.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, max_position_embeddings=max_pos,
        tie_word_embeddings=tie, rms_norm_eps=1e-5, rope_theta=10000.0, initializer_range=0.3,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(path)
    return path


# transformers' config and model classes of each architecture workers/models/ implements
_HF_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
               "mistral": ("MistralConfig", "MistralForCausalLM"),
               "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
               "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
               "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
               "glm4": ("Glm4Config", "Glm4ForCausalLM")}


def make_tiny_model(path: str | Path, architecture: str, *, seed: int = 0, std: float = 0.3,
                    **config) -> Path:
    """Write a seeded random-weight HF directory of `architecture` (a key of workers/models'
    registry) from transformers' own config and model classes; `config` are the config class's
    keyword arguments (tiny sizes are the caller's). Every weight is drawn from N(0, std), and
    every norm weight around its neutral value (1, or 0 for Gemma's 1 + w), so that no part of
    the model is an identity a bug could hide behind."""
    import torch
    import transformers

    config_name, model_name = _HF_CLASSES[architecture]
    hf_config = getattr(transformers, config_name)(**config)
    path = Path(path)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        model = getattr(transformers, model_name)(hf_config).to(torch.float32)
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0.0 if architecture == "gemma3" else 1.0, 0.2)
            else:
                param.normal_(0.0, std)
    model.save_pretrained(path)
    return path


@functools.lru_cache(maxsize=1)   # tests ask for the same reference several times in a row
def hf_model(model_dir: str | Path):
    """transformers' own model of a checkpoint in fp32, eval mode (a described GGUF directory:
    built from our reader of the GGUF it names, hf_model_from_gguf). Not to be modified."""
    import torch
    from transformers import AutoModelForCausalLM

    from pagedserve.workers.gguf_files import gguf_source
    if gguf_source(Path(model_dir)) is None:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return hf_model_from_gguf(model_dir)


def hf_model_from_gguf(model_dir: str | Path):
    """transformers' model class for a described GGUF directory, with the weights our reader
    dequantizes (workers/gguf_weights.py): transformers' own GGUF loading dequantizes in numpy
    at a minute for Gemma 3 270M, and gives the same tensors
    (tests/workers/test_gguf_weights.py holds the reader to it)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pagedserve.workers.loader import iter_weights
    from transformers.initialization import no_init_weights
    config = AutoConfig.from_pretrained(model_dir)
    with no_init_weights():   # every weight is loaded below: no random init to pay for
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = dict(iter_weights(model_dir, torch.float32, keep_quantized=False))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [name for name in missing if name != "lm_head.weight" or not config.tie_word_embeddings]
    if missing or unexpected:
        raise ValueError(f"{model_dir}: missing {missing[:4]}, unexpected {unexpected[:4]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def hf_greedy(model_dir: str | Path, prompts: list[list[int]], max_new_tokens: int, *,
              eos_token_ids: Iterable[int] = ()) -> list[list[int]]:
    """Greedy-decode each prompt alone (batch of one, no padding) with transformers in fp32.

    Returns only the generated ids: exactly max_new_tokens of them (like ignore_eos), or up to
    and including the first id in eos_token_ids when that is given.
    """
    import inspect

    import torch
    from transformers import DynamicCache

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if any(not prompt for prompt in prompts):
        raise ValueError("every prompt needs at least one token id")
    stop = set(eos_token_ids)
    model = hf_model(model_dir)
    # transformers 5.x renames forward's past_key_values to cache; accept either spelling.
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters \
        else "past_key_values"
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            input_ids = torch.tensor([prompt], dtype=torch.long)
            kv_cache = DynamicCache(config=model.config)
            generated: list[int] = []
            for _ in range(max_new_tokens):
                out = model(input_ids=input_ids, use_cache=True, **{cache_arg: kv_cache})
                token = int(out.logits[0, -1].argmax())
                generated.append(token)
                if token in stop:
                    break
                input_ids = torch.tensor([[token]], dtype=torch.long)
            outputs.append(generated)
    return outputs


def hf_prompt_logprobs(model_dir: str | Path, prompt: list[int]):
    """transformers' log_softmax over the vocabulary at every position of `prompt` but the
    last, in fp32: row p is the distribution of prompt token p + 1 ([len - 1, vocab])."""
    import torch

    model = hf_model(model_dir)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt], dtype=torch.long)).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)
