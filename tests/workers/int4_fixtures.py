"""Builders of AWQ and GPTQ int4 checkpoints for tests: one linear's packed tensors, or a whole
tiny quantized Llama directory (config.json with quantization_config + model.safetensors).

Quantization is plain round-to-nearest min/max (GPTQ's own quantizer grid: sym puts the zero at
8 with scale = 2 * amax / 15; asym scale = (max - min) / 15, zero = round(-min / scale)); what
matters here is the packing, which follows the formats' published code (neither library installs
on this CPU-only torch; their pinned torch is newer):
- AWQ GEMM: AutoAWQ 0.2.9 `WQLinear_GEMM.from_linear` (awq/modules/linear/gemm.py): codes
  transposed to [k, n], 8 columns a word with order_map [0, 2, 4, 6, 1, 3, 5, 7], zeros alike.
- GPTQ: GPTQModel 7.7 `BaseQuantLinear.pack_original` (qweight [k/8, n], 8 rows a word in order;
  qzeros [k/g, n/8], 8 columns a word in order), then its v2 -> v1 export
  (`convert_gptq_v2_to_v1_format_module`: qzeros -= 0x11111111 on the whole int32 word) for
  checkpoint_format "gptq". `g_idx` is the group of each input column: k // g, or with desc_act
  the groups of a random column order (as GPTQ's act-order assigns them).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import torch

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


@dataclasses.dataclass
class Int4Codes:
    """A linear quantized to int4:
    w[r, c] ~ (q[r, c] - zeros[g_idx[c], r]) * scales[g_idx[c], r]."""
    q: torch.Tensor        # int32 [n, k], 0..15
    zeros: torch.Tensor    # int32 [G, n], 0..15
    scales: torch.Tensor   # float16 [G, n]
    g_idx: torch.Tensor    # int32 [k]

    def dequantize(self) -> torch.Tensor:
        """The exact fp32 weight [n, k] these codes stand for (the ground truth)."""
        g = self.g_idx.long()
        z = self.zeros.t()[:, g].float()
        s = self.scales.t()[:, g].float()
        return (self.q.float() - z) * s


def quantize_int4(weight: torch.Tensor, group_size: int, *, sym: bool = False,
                  desc_act: bool = False, seed: int = 0) -> Int4Codes:
    """Round-to-nearest int4 of an fp32 weight [n, k] in groups of `group_size` input columns
    (-1: one group); with desc_act the groups are taken over a random column order."""
    n, k = weight.shape
    group_size = k if group_size == -1 else group_size
    groups = k // group_size
    order = torch.arange(k)
    if desc_act:
        order = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // group_size).to(torch.int32)
    grouped = weight.float()[:, order].reshape(n, groups, group_size)
    lo = grouped.amin(-1).clamp(max=0)
    hi = grouped.amax(-1).clamp(min=0)
    if sym:
        scale = torch.maximum(-lo, hi) * 2 / 15
        zero = torch.full_like(scale, 8)
    else:
        scale = (hi - lo) / 15
    scale = torch.where(scale == 0, torch.ones_like(scale), scale).half().float()
    if not sym:
        zero = torch.round(-lo / scale).clamp(0, 15)
    s = scale.t()[g_idx.long()].t()                   # [n, k] by column
    z = zero.t()[g_idx.long()].t()
    q = torch.clamp(torch.round(weight.float() / s) + z, 0, 15).to(torch.int32)
    return Int4Codes(q, zero.t().to(torch.int32).contiguous(),
                     scale.t().half().contiguous(), g_idx)


# ---------------------------------------------------------------- packing

def pack_awq_gemm(codes: Int4Codes) -> dict[str, torch.Tensor]:
    """AutoAWQ GEMM tensors {qweight, qzeros, scales} (from_linear's packing loops)."""
    if not torch.equal(codes.g_idx.long(), torch.sort(codes.g_idx.long()).values):
        raise ValueError("AWQ has no act-order: g_idx must be k // group_size")
    intweight = codes.q.t().contiguous()              # [k, n]
    return {"qweight": _pack_columns(intweight, AWQ_ORDER),
            "qzeros": _pack_columns(codes.zeros, AWQ_ORDER),
            "scales": codes.scales.clone()}


def _pack_columns(values: torch.Tensor, order: list[int]) -> torch.Tensor:
    """[rows, cols] -> int32 [rows, cols / 8]: word c holds column 8c + order[i] at bits 4i."""
    packed = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int32)
    for col in range(packed.shape[1]):
        for i in range(8):
            packed[:, col] |= values[:, col * 8 + order[i]].to(torch.int32) << (i * 4)
    return packed


def pack_gptq(codes: Int4Codes, *, checkpoint_format: str = "gptq") -> dict[str, torch.Tensor]:
    """GPTQ tensors {qweight, qzeros, scales, g_idx} (GPTQModel's pack_original, then its
    v2 -> v1 export for checkpoint_format "gptq")."""
    int_weight = codes.q.t().contiguous().numpy().astype(np.uint32)   # [k, n]
    qweight = np.zeros((int_weight.shape[0] // 8, int_weight.shape[1]), dtype=np.uint32)
    for row in range(qweight.shape[0]):
        for j in range(8):
            qweight[row] |= int_weight[row * 8 + j] << (4 * j)
    zeros = codes.zeros.numpy().astype(np.uint32)
    qzeros = np.zeros((zeros.shape[0], zeros.shape[1] // 8), dtype=np.uint32)
    for col in range(qzeros.shape[1]):
        for j in range(8):
            qzeros[:, col] |= zeros[:, col * 8 + j] << (4 * j)
    if checkpoint_format == "gptq":
        qzeros = qzeros - np.uint32(0x11111111)   # wraps (and borrows) like int32 words
    elif checkpoint_format != "gptq_v2":
        raise ValueError(f"unknown checkpoint_format {checkpoint_format!r}")
    return {"qweight": torch.from_numpy(qweight.view(np.int32).copy()),
            "qzeros": torch.from_numpy(qzeros.view(np.int32).copy()),
            "scales": codes.scales.clone(), "g_idx": codes.g_idx.clone()}


def quantize_linear(weight: torch.Tensor, method: str, group_size: int, *, sym: bool = False,
                    desc_act: bool = False, checkpoint_format: str = "gptq", seed: int = 0
                    ) -> tuple[dict[str, torch.Tensor], Int4Codes]:
    """An fp32 weight [n, k] -> (its packed tensors by part name, the codes they hold)."""
    if method == "awq":
        codes = quantize_int4(weight, group_size, sym=False)
        return pack_awq_gemm(codes), codes
    codes = quantize_int4(weight, group_size, sym=sym, desc_act=desc_act, seed=seed)
    return pack_gptq(codes, checkpoint_format=checkpoint_format), codes


def quantization_config(method: str, group_size: int, *, sym: bool = False,
                        desc_act: bool = False, checkpoint_format: str = "gptq") -> dict:
    """config.json's quantization_config as AutoAWQ / GPTQModel write it."""
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}
    return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act,
            "sym": sym, "static_groups": False, "true_sequential": True, "damp_percent": 0.01,
            "checkpoint_format": checkpoint_format, "pack_dtype": "int32"}


# ---------------------------------------------------------------- model directories

LINEAR_SUFFIXES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def write_quantized_llama(path: str | Path, method: str = "gptq", group_size: int = 128, *,
                          sym: bool = True, desc_act: bool = False,
                          checkpoint_format: str = "gptq", seed: int = 0,
                          hidden_size: int = 128, intermediate_size: int = 256,
                          num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                          vocab_size: int = 512, tie: bool = False, std: float = 0.3,
                          dtype: torch.dtype = torch.float16,
                          reference_dir: str | Path | None = None) -> Path:
    """A tiny random Llama (transformers' LlamaConfig) with every decoder linear quantized
    (`method` "awq" or "gptq"), embeddings, norms and lm_head kept as `dtype`: config.json with
    its quantization_config and model.safetensors. With `reference_dir`, also the same model
    with each linear replaced by its exact dequantization, as a plain fp32 HF directory that
    transformers loads without any quantization library (the reference for end-to-end runs)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, max_position_embeddings=2048,
        tie_word_embeddings=tie, rms_norm_eps=1e-5, rope_theta=10000.0,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.2)
            else:
                param.normal_(0.0, std)
    quantized = {f"model.layers.{i}.{suffix}" for i in range(num_layers)
                 for suffix in LINEAR_SUFFIXES}
    tensors, reference = {}, {}
    for index, (name, tensor) in enumerate(model.state_dict().items()):
        prefix = name.removesuffix(".weight")
        if prefix in quantized:
            parts, codes = quantize_linear(tensor, method, group_size, sym=sym,
                                           desc_act=desc_act, checkpoint_format=checkpoint_format,
                                           seed=seed * 1000 + index)
            tensors.update({f"{prefix}.{part}": t for part, t in parts.items()})
            reference[name] = codes.dequantize()
        elif not (tie and name == "lm_head.weight"):
            tensors[name] = tensor.to(dtype).contiguous()
            reference[name] = tensors[name].float()
    path.mkdir(parents=True, exist_ok=True)
    config.dtype = dtype
    config.save_pretrained(path)
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"] = quantization_config(method, group_size, sym=sym,
                                                     desc_act=desc_act,
                                                     checkpoint_format=checkpoint_format)
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    if reference_dir is not None:
        reference_dir = Path(reference_dir)
        reference_dir.mkdir(parents=True, exist_ok=True)
        config.dtype = torch.float32
        config.save_pretrained(reference_dir)
        save_file(reference, reference_dir / "model.safetensors", metadata={"format": "pt"})
    return path
