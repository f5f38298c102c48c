"""workers/gguf_weights.py: a GGUF's tensors under Hugging Face names equal transformers' own
reading of the file (its dequantization, llama's q/k rows un-permuted), and the tests'
transformers reference built from them (workers/testing.hf_model_from_gguf) is that model."""
from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.quant_formats import QuantizedWeight
from pagedserve.pipeline.load_error import ModelLoadError
from pagedserve.workers.gguf_files import gguf_source
from pagedserve.workers.gguf_weights import hf_name
from pagedserve.workers.loader import TEST_MODEL, iter_weights, resolve_model
from pagedserve.workers.testing import hf_model_from_gguf

pytestmark = pytest.mark.slow


def test_smollm2_tensors_equal_transformers_reading_of_the_file():
    """SmolLM2 is a llama: its q/k rows were permuted by llama.cpp's converter."""
    from transformers import AutoModelForCausalLM
    model_dir = resolve_model(TEST_MODEL)
    gguf = gguf_source(model_dir)
    theirs = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                  dtype=torch.float32).state_dict()
    ours = hf_model_from_gguf(model_dir).state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    kept = dict(iter_weights(model_dir))
    q = kept["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q, QuantizedWeight) and q.qtype.name == "Q4_1"
    assert torch.equal(q.dequantize(), theirs["model.layers.0.self_attn.q_proj.weight"])


def test_names_map_and_unknown_tensors_are_refused():
    assert hf_name("blk.3.ffn_down.weight", "qwen2") == "model.layers.3.mlp.down_proj.weight"
    assert hf_name("blk.0.ffn_norm.weight", "gemma3") == \
        "model.layers.0.pre_feedforward_layernorm.weight"
    assert hf_name("blk.0.ffn_norm.weight", "llama") == \
        "model.layers.0.post_attention_layernorm.weight"
    assert hf_name("rope_freqs.weight", "llama") is None
    with pytest.raises(ModelLoadError, match="blk.0.ssm_conv1d.weight"):
        hf_name("blk.0.ssm_conv1d.weight", "llama")


def test_a_tensor_of_a_type_the_engine_does_not_know_is_named_at_start(tmp_path):
    """A tensor type id no ggml version defines: the header check names the tensor."""
    import numpy as np
    from gguf import GGUFWriter

    from pagedserve.workers.gguf_files import check_gguf
    path = tmp_path / "odd.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    data = bytearray(path.read_bytes())
    name = b"blk.0.attn_q.weight"
    at = data.index(name) + len(name) + 4 + 2 * 8      # n_dims (u32), two dims (u64)
    assert int.from_bytes(data[at:at + 4], "little") == 0    # F32
    data[at:at + 4] = (99).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="tensor blk.0.attn_q.weight has tensor type 99"):
        check_gguf(path)


def test_an_untied_models_embedding_table_stays_a_mapping_of_the_file(tmp_path):
    """With its own LM head (output.weight), a model only looks rows of token_embd up: the table
    is a private mapping of the file (resident only where rows were read), the LM head is read
    into memory as every other weight."""
    from script_module import load_script
    from pagedserve.workers.gguf_weights import iter_gguf_weights
    script = load_script("write_random_gguf")
    path = tmp_path / "tiny.gguf"
    script.write_random_gguf(path, script.PRESETS["tiny"], "Q4_K")
    weights = dict(iter_gguf_weights(path, {"num_attention_heads": 4, "num_key_value_heads": 2},
                                     torch.float32))
    table, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    assert isinstance(table, QuantizedWeight) and table.qtype.name == "Q4_K"

    def mapped_from_file(t: torch.Tensor) -> bool:
        ptr = t.data_ptr()
        for line in open("/proc/self/maps"):
            span, *_, name = line.split(maxsplit=5)
            low, high = (int(x, 16) for x in span.split("-"))
            if low <= ptr < high:
                return name.strip() == str(path)
        return False
    assert mapped_from_file(table.data) and not mapped_from_file(head.data)
    # the same bytes as reading: the rows dequantize alike
    tied = dict(iter_gguf_weights(path, {"num_attention_heads": 4, "num_key_value_heads": 2},
                                  torch.float32, keep_quantized=False))
    rows = torch.tensor([0, 7, 31999])
    assert torch.equal(table.dequantize()[rows], tied["model.embed_tokens.weight"][rows])
