"""Test helpers: random LoRA adapters written by peft, and peft's own greedy decode."""
from __future__ import annotations

from pathlib import Path

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_peft_adapter(base_dir: str | Path, out_dir: str | Path, *, rank: int, seed: int,
                      alpha: int | None = None, rslora: bool = False,
                      targets: list[str] | None = None, std: float = 0.3) -> Path:
    """A PEFT LoRA folder for the model in `base_dir`, every A and B drawn from N(0, std) (peft
    starts B at zero, which would test nothing)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, use_rslora=rslora,
                        target_modules=targets or TARGETS, init_lora_weights=False)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        model = get_peft_model(base, config)
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, std)
    model.save_pretrained(out_dir)
    return Path(out_dir)


def peft_greedy(base_dir: str | Path, adapter_dir: str | Path | None, prompt: list[int],
                max_new_tokens: int) -> list[int]:
    """transformers (+ peft with an adapter) greedy tokens after `prompt`, ignoring EOS."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, adapter_dir)
    with torch.inference_mode():
        out = model.eval().generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                                    min_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def peft_to_gguf(adapter_dir: str | Path, out_file: str | Path, *, num_heads: int,
                 num_kv_heads: int) -> Path:
    """The GGUF that llama.cpp's convert_lora_to_gguf.py writes for a llama PEFT adapter (F32):
    general.type adapter, adapter.lora.alpha, blk.N.<name>.weight.lora_a/lora_b, q/k rows of
    lora_b permuted as its converter permutes the base model's q/k."""
    import json

    import gguf
    from safetensors.torch import load_file

    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    config = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    writer = gguf.GGUFWriter(str(out_file), "llama")
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(config["lora_alpha"]))
    for name, value in sorted(load_file(Path(adapter_dir) / "adapter_model.safetensors").items()):
        parts = name.split(".")
        layer, module, half = parts[parts.index("layers") + 1], parts[-3], parts[-2][-1]
        if half == "B" and module in ("q_proj", "k_proj"):
            heads = num_heads if module == "q_proj" else num_kv_heads
            value = value.reshape(heads, 2, value.shape[0] // heads // 2, value.shape[1])
            value = value.swapaxes(1, 2).reshape(-1, value.shape[-1])
        writer.add_tensor(f"blk.{layer}.{names[module]}.weight.lora_{half.lower()}",
                          value.float().contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(out_file)
