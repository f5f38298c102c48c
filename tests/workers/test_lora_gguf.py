"""LoRA adapters as llama.cpp writes them (GGUF: general.type adapter, lora_a/lora_b tensors,
q/k rows of lora_b permuted): greedy tokens equal transformers + peft with the PEFT adapter the
file came from; a GGUF that is not an adapter is refused naming why."""
from __future__ import annotations

import pytest

from pagedserve.pipeline.ingress.testing import make_tiny_tokenizer
from pagedserve.pipeline.llm import LLM
from pagedserve.pipeline.lora_files import LoRAFileError
from pagedserve.pipeline.lora_request import LoRARequest
from pagedserve.pipeline.sampling_params import SamplingParams
from pagedserve.workers.lora.testing import make_peft_adapter, peft_greedy, peft_to_gguf
from pagedserve.workers.testing import make_tiny_llama


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    path = make_tiny_llama(tmp_path_factory.mktemp("gguf-lora-base"), seed=7, vocab_size=259)
    make_tiny_tokenizer().save_pretrained(path)
    return path


def test_gguf_adapter_gives_peft_greedy_tokens(base_dir, tmp_path):
    peft_dir = make_peft_adapter(base_dir, tmp_path / "peft", rank=8, seed=11)
    gguf_file = peft_to_gguf(peft_dir, tmp_path / "adapter.gguf", num_heads=4, num_kv_heads=2)
    llm = LLM(model=str(base_dir), in_process=True, dtype="float32", kv_cache_memory="8MiB",
              block_size=8, swap_space=0.0, enable_lora=True, max_lora_rank=8)
    prompts = [[3, 4, 5, 6, 7, 8], [40, 41, 42]]
    lora = LoRARequest(lora_name="g", lora_int_id=1, lora_path=str(gguf_file))
    outputs = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True,
                                                   temperature=0.0), lora_request=lora)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == peft_greedy(base_dir, peft_dir, prompt, 8)
    not_adapter = LoRARequest(lora_name="m", lora_int_id=2, lora_path=str(
        _model_gguf(tmp_path / "model.gguf")))
    with pytest.raises(LoRAFileError, match="is not a LoRA adapter GGUF"):
        llm.generate(prompts[:1], lora_request=not_adapter)


def _model_gguf(path):
    import gguf
    import numpy as np
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.ones((8, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
