"""AWQ / GPTQ int4 checkpoints read into I4G QuantizedWeights (workers/int4_checkpoints.py).

Each packed linear is checked twice, exactly: against an unpacking of its tensors written here
from the formats' descriptions (independent of the module's byte-view repacking), and against
the codes the fixture quantized to. transformers cannot load these checkpoints here (both AWQ
and GPTQ need gptqmodel, which pins a newer torch), so there is no transformers comparison.
"""
from __future__ import annotations

import json

import pytest
import torch
from pagedserve.kernels.quant_formats import QType, QuantizedWeight
from pagedserve.workers.int4_checkpoints import (
    Int4Scheme,
    detect_quantization,
    iter_int4_weights,
    repack_int4,
)
from pagedserve.pipeline.load_error import ModelLoadError
from safetensors.torch import save_file

from int4_fixtures import (
    AWQ_ORDER,
    quantization_config,
    quantize_linear,
    write_quantized_llama,
)

N, K = 64, 256


def _weight(seed: int = 0) -> torch.Tensor:
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(seed))
    w[3] = w[3].abs()      # asym zeros of 0 in every group of row 3: GPTQ v1's borrow case
    return w


# ---------------------------------------------------------------- reference unpacking

def _unpack_along_cols(words: torch.Tensor, order) -> torch.Tensor:
    """[r, c] int32 -> [r, 8c]: column 8j + order[i] is nibble i of word j."""
    out = torch.empty(words.shape[0], words.shape[1] * 8, dtype=torch.int64)
    for i in range(8):
        out[:, order[i]::8] = (words.long() >> (4 * i)) & 0xF
    return out


def reference_dequantize(method: str, parts: dict, group_size: int, v1: bool = True):
    """fp32 [n, k] = (q - z) * s of the packed tensors, unpacked nibble by nibble."""
    if method == "awq":
        q = _unpack_along_cols(parts["qweight"], AWQ_ORDER)               # [k, n]
        z = _unpack_along_cols(parts["qzeros"], AWQ_ORDER)                # [G, n]
        k = q.shape[0]
        groups = torch.arange(k) // (k if group_size == -1 else group_size)
    else:
        qweight = parts["qweight"].long()
        q = torch.empty(qweight.shape[0] * 8, qweight.shape[1], dtype=torch.int64)
        for i in range(8):
            q[i::8] = (qweight >> (4 * i)) & 0xF                          # row 8r + i
        words = parts["qzeros"].long() & 0xFFFFFFFF
        if v1:      # GPTQModel's v1 -> v2: + 0x11111111 on the whole 32-bit word
            words = (words + 0x11111111) & 0xFFFFFFFF
        z = _unpack_along_cols(words, range(8))
        groups = parts["g_idx"].long()
    s = parts["scales"].float()
    return ((q - z[groups]).float() * s[groups]).t()


def _read_one(tmp_path, parts: dict, qconfig: dict, prefix: str = "layer.proj"):
    tensors = {f"{prefix}.{name}": t for name, t in parts.items()}
    tensors["layer.norm.weight"] = torch.ones(4)
    _write_dir(tmp_path, tensors, qconfig)
    out = dict(iter_int4_weights(tmp_path, {"quantization_config": qconfig}))
    assert torch.equal(out.pop("layer.norm.weight"), torch.ones(4))
    assert list(out) == [f"{prefix}.weight"]
    return out[f"{prefix}.weight"]


def _write_dir(path, tensors: dict, qconfig: dict, shards: list[set[str]] | None = None):
    (path / "config.json").write_text(json.dumps({"quantization_config": qconfig}))
    if shards is None:
        save_file(tensors, path / "model.safetensors")
        return
    weight_map = {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, path / file)
        weight_map.update({n: file for n in names})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


# ---------------------------------------------------------------- exact repacking

@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_awq_gemm_dequantizes_exactly(tmp_path, group_size):
    parts, codes = quantize_linear(_weight(group_size), "awq", group_size)
    weight = _read_one(tmp_path, parts, quantization_config("awq", group_size))
    assert isinstance(weight, QuantizedWeight) and weight.qtype == QType.I4G
    assert weight.shape == (N, K) and weight.perm is None
    w = weight.dequantize()
    assert torch.equal(w, reference_dequantize("awq", parts, group_size))
    assert torch.equal(w, codes.dequantize())


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("desc_act", [False, True], ids=["in-order", "desc_act"])
@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
def test_gptq_dequantizes_exactly(tmp_path, sym, desc_act, group_size):
    parts, codes = quantize_linear(_weight(group_size), "gptq", group_size, sym=sym,
                                   desc_act=desc_act, seed=group_size)
    qconfig = quantization_config("gptq", group_size, sym=sym, desc_act=desc_act)
    weight = _read_one(tmp_path, parts, qconfig)
    assert weight.shape == (N, K)
    w = weight.dequantize()
    assert torch.equal(w, reference_dequantize("gptq", parts, group_size))
    assert torch.equal(w, codes.dequantize())
    if desc_act:   # stored columns in argsort(g_idx) order: each block of 32 is one group
        assert torch.equal(weight.perm, torch.argsort(parts["g_idx"].long(), stable=True))
    else:
        assert weight.perm is None


def test_gptq_v1_reads_borrowed_zero_words():
    """A zero of 0 stored as 0 - 1 borrows from the next nibble of the word (GPTQModel's export):
    read back by whole-word addition, not nibble by nibble."""
    parts, codes = quantize_linear(_weight(), "gptq", 32, sym=False)
    assert (codes.zeros[:, 3] == 0).all()
    assert (parts["qzeros"][:, 0] >> 12 & 0xF == 0xF).all()   # row 3's nibble holds -1
    weight = repack_int4(Int4Scheme("gptq", 32, 1), parts["qweight"], parts["qzeros"],
                         parts["scales"], parts["g_idx"])
    assert torch.equal(weight.dequantize(), codes.dequantize())


@pytest.mark.parametrize("method,group_size,fmt", [("gptq", 64, "gptq_v2"), ("gptq", -1, "gptq"),
                                                  ("awq", -1, "gptq")])
def test_gptq_v2_and_per_channel_groups(tmp_path, method, group_size, fmt):
    parts, codes = quantize_linear(_weight(1), method, group_size, sym=False, desc_act=True,
                                   checkpoint_format=fmt)
    qconfig = quantization_config(method, group_size, checkpoint_format=fmt)
    w = _read_one(tmp_path, parts, qconfig).dequantize()
    assert torch.equal(w, reference_dequantize(method, parts, group_size, v1=fmt == "gptq"))
    assert torch.equal(w, codes.dequantize())


def test_i4g_block_layout(tmp_path):
    """Block bytes: fp32 d = scale, fp32 m = -scale * zero, element j low / j + 16 high nibble."""
    parts, codes = quantize_linear(_weight(), "awq", 64)
    weight = _read_one(tmp_path, parts, quantization_config("awq", 64))
    blocks = weight.data.view(N, K // 32, 24)
    row, block = 5, 3                                    # columns 96..127: group 1
    d = blocks[row, block, 0:4].clone().view(torch.float32).item()
    m = blocks[row, block, 4:8].clone().view(torch.float32).item()
    assert d == codes.scales[1, row].item()
    assert m == -codes.scales[1, row].item() * codes.zeros[1, row].item()
    nibbles = blocks[row, block, 8:24].long()
    assert torch.equal(nibbles & 0xF, codes.q[row, 96:112].long())
    assert torch.equal(nibbles >> 4, codes.q[row, 112:128].long())


# ---------------------------------------------------------------- whole checkpoints

@pytest.mark.parametrize("method,group_size,sym,desc_act", [("awq", 128, False, False),
                                                            ("gptq", 32, False, True)])
def test_tiny_llama_checkpoint(tmp_path, method, group_size, sym, desc_act):
    from safetensors.torch import load_file
    model_dir = write_quantized_llama(tmp_path / "q", method, group_size, sym=sym,
                                      desc_act=desc_act, reference_dir=tmp_path / "ref")
    config = json.loads((model_dir / "config.json").read_text())
    assert detect_quantization(config) == method
    reference = load_file(tmp_path / "ref" / "model.safetensors")
    loaded = dict(iter_int4_weights(model_dir, config))
    assert set(loaded) == set(reference)
    linears = [name for name, t in loaded.items() if isinstance(t, QuantizedWeight)]
    assert len(linears) == 2 * 7
    for name, tensor in loaded.items():
        got = tensor.dequantize() if isinstance(tensor, QuantizedWeight) else tensor.float()
        assert torch.equal(got, reference[name]), name
    assert loaded["model.embed_tokens.weight"].dtype == torch.float16


def test_linear_split_across_shards(tmp_path):
    parts, codes = quantize_linear(_weight(), "gptq", 128, sym=True)
    tensors = {f"a.proj.{part}": t for part, t in parts.items()}
    tensors["a.norm.weight"] = torch.ones(4)
    _write_dir(tmp_path, tensors, quantization_config("gptq", 128),
               shards=[{"a.proj.qweight", "a.norm.weight"},
                       {"a.proj.qzeros", "a.proj.scales", "a.proj.g_idx"}])
    out = list(iter_int4_weights(tmp_path, {"quantization_config": quantization_config("gptq",
                                                                                       128)}))
    assert [name for name, _ in out] == ["a.norm.weight", "a.proj.weight"]
    assert torch.equal(out[1][1].dequantize(), codes.dequantize())


# ---------------------------------------------------------------- refusals

def test_detect_quantization():
    assert detect_quantization({}) is None
    assert detect_quantization({"quantization_config": None}) is None
    assert detect_quantization({"quantization_config": quantization_config("awq", 64)}) == "awq"
    assert detect_quantization({"quantization_config": quantization_config("gptq", 32)}) == "gptq"
    legacy_awq = {"quant_method": "awq", "w_bit": 4, "q_group_size": 128, "version": "GEMM"}
    assert detect_quantization({"quantization_config": legacy_awq}) == "awq"


AWQ, GPTQ = quantization_config("awq", 128), quantization_config("gptq", 128)


@pytest.mark.parametrize("qconfig,message", [
    ({"quant_method": "fp8"}, "quant_method 'fp8' is not supported"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
    ({**GPTQ, "bits": 8}, "bits=8"),
    ({**AWQ, "bits": 3}, "bits=3"),
    ({**GPTQ, "group_size": 256}, "group_size=256"),
    ({**AWQ, "group_size": 16}, "group_size=16"),
    ({**AWQ, "version": "gemv"}, "AWQ version 'gemv'"),
    ({**AWQ, "version": "gemv_fast"}, "AWQ version 'gemv_fast'"),
    ({**AWQ, "backend": "llm-awq"}, "llm-awq"),
    ({**AWQ, "zero_point": False}, "zero_point=false"),
    ({**GPTQ, "checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    ({**GPTQ, "is_marlin_format": True}, "checkpoint_format 'marlin'"),
    ({**GPTQ, "pack_dtype": "int16"}, "pack_dtype 'int16'"),
    ({**GPTQ, "dynamic": {"-:.*lm_head": {}}}, "dynamic"),
    ("gptq", "quantization_config must be a JSON object"),
])
def test_unsupported_config_refused(qconfig, message):
    with pytest.raises(ModelLoadError) as e:
        detect_quantization({"quantization_config": qconfig})
    assert str(e.value).startswith("config.json: ") and message in str(e.value), str(e.value)


def _gptq_parts(group_size: int = 64, desc_act: bool = False):
    return quantize_linear(_weight(), "gptq", group_size, sym=False, desc_act=desc_act)[0]


def _bad(parts: dict, **changes) -> dict:
    parts = dict(parts)
    for part, value in changes.items():
        if value is None:
            del parts[part]
        else:
            parts[part] = value
    return parts


@pytest.mark.parametrize("method,change,message", [
    ("gptq", {"qzeros": None}, "layer.proj.qweight has no layer.proj.qzeros"),
    ("gptq", {"scales": None}, "layer.proj.qweight has no layer.proj.scales"),
    ("awq", {"qweight": None}, "layer.proj.qzeros has no layer.proj.qweight"),
    ("gptq", {"scales": torch.ones(4, N // 2, dtype=torch.float16)},
     "layer.proj.scales: shape (4, 32) does not agree"),
    ("awq", {"scales": torch.ones(2, N, dtype=torch.float16)},
     "layer.proj.scales: shape (2, 64) does not agree"),
    ("gptq", {"qzeros": torch.zeros(4, N // 4, dtype=torch.int32)},
     "layer.proj.qzeros: shape (4, 16) does not agree"),
    ("gptq", {"qweight": torch.zeros(K // 8 - 4, N, dtype=torch.int32)},
     ("layer.proj.qweight: shape (28, 64) holds k = 224 input columns, not a positive "
      "multiple of the group size 64")),
    ("gptq", {"qweight": torch.zeros(K // 8, N, dtype=torch.int64)},
     "layer.proj.qweight: expected a 2-D int32 tensor, got torch.int64"),
    ("gptq", {"scales": torch.ones(4, N, dtype=torch.int32)}, "layer.proj.scales: expected"),
    ("gptq", {"g_idx": torch.zeros(K - 8, dtype=torch.int32)},
     "layer.proj.g_idx: has 248 entries but qweight has k = 256"),
    ("gptq", {"g_idx": torch.arange(K, dtype=torch.int32) // 32},
     "layer.proj.g_idx: group 4 is out of range [0, 4)"),
    ("gptq", {"g_idx": torch.cat([torch.ones(1, dtype=torch.int32),
                                  torch.arange(1, K, dtype=torch.int32) // 64])},
     "layer.proj.g_idx: its groups are not whole blocks of 32 columns"),
    ("awq", {"g_idx": torch.arange(K, dtype=torch.int32) // 64},
     "layer.proj.g_idx: AWQ checkpoints have no g_idx"),
    ("gptq", {"weight": torch.zeros(N, K)}, "both layer.proj.weight and layer.proj.qweight"),
])
def test_bad_tensors_refused(tmp_path, method, change, message):
    if method == "awq":
        parts = quantize_linear(_weight(), "awq", 64)[0]
    else:
        parts = _gptq_parts()
    tensors = {f"layer.proj.{p}": t for p, t in _bad(parts, **change).items()}
    qconfig = quantization_config(method, 64)
    _write_dir(tmp_path, tensors, qconfig)
    with pytest.raises(ModelLoadError) as e:
        list(iter_int4_weights(tmp_path, {"quantization_config": qconfig}))
    assert str(tmp_path) in str(e.value) and message in str(e.value), str(e.value)


def test_unquantized_config_refused(tmp_path):
    save_file({"w": torch.ones(2)}, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match="has no quantization_config"):
        list(iter_int4_weights(tmp_path, {}))
