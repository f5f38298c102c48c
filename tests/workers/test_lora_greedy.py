"""LoRA end to end in one process (LLM(in_process=True)): four random PEFT adapters (rank 8
and 64, one with rsLoRA) and the base model in one batch give transformers + peft's greedy
tokens, each prompt its own adapter's; bad adapters are refused naming the cause."""
from __future__ import annotations

import json

import pytest

from pagedserve.pipeline.ingress.testing import make_tiny_tokenizer
from pagedserve.pipeline.llm import LLM
from pagedserve.pipeline.lora_files import LoRAFileError
from pagedserve.pipeline.lora_request import LoRARequest
from pagedserve.pipeline.outputs import RequestError
from pagedserve.pipeline.sampling_params import SamplingParams
from pagedserve.workers.lora.testing import make_peft_adapter, peft_greedy
from pagedserve.workers.testing import make_tiny_llama

ADAPTERS = [(8, False), (64, True), (8, False), (64, False)]   # (rank, rsLoRA)
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    path = make_tiny_llama(tmp_path_factory.mktemp("lora-base"), seed=5, vocab_size=259)
    make_tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def adapters(base_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return [LoRARequest(lora_name=f"a{i}", lora_int_id=i + 1, lora_path=str(make_peft_adapter(
        base_dir, root / f"a{i}", rank=rank, seed=100 + i, rslora=rslora)))
        for i, (rank, rslora) in enumerate(ADAPTERS)]


def _llm(base_dir, **extra):
    return LLM(model=str(base_dir), in_process=True, dtype="float32", kv_cache_memory="8MiB",
               block_size=8, max_num_seqs=8, max_num_batched_tokens=64, swap_space=0.0,
               enable_lora=True, **{"max_lora_rank": 64, **extra})


def test_four_adapters_and_the_base_in_one_batch_give_peft_greedy_tokens(base_dir, adapters):
    llm = _llm(base_dir, max_loras=4)
    # the same prompt under two adapters and the base: a shared prefix never crosses adapters
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22, 23], [5, 6, 7, 8, 9, 10, 11, 12, 13],
               [50, 51, 52], [5, 6, 7, 8, 9, 10, 11, 12, 13]]
    loras = [*adapters, None]
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0)
    outputs = llm.generate(prompts, params, lora_request=loras)
    for prompt, lora, out in zip(prompts, loras, outputs):
        want = peft_greedy(base_dir, lora.lora_path if lora else None, prompt, MAX_TOKENS)
        assert out.outputs[0].token_ids == want, lora.lora_name if lora else "base"


def test_more_adapters_than_slots_take_turns(base_dir, adapters):
    """max_loras 2 with four adapters: steps never mix more than two; all finish correctly."""
    llm = _llm(base_dir, max_loras=2, max_cpu_loras=2)
    prompts = [[30 + i, 31, 32, 33] for i in range(4)]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True,
                                                   temperature=0.0), lora_request=adapters)
    for prompt, lora, out in zip(prompts, adapters, outputs):
        assert out.outputs[0].token_ids == peft_greedy(base_dir, lora.lora_path, prompt, 4)


def test_bad_adapters_are_refused_naming_the_cause(base_dir, adapters, tmp_path):
    llm = _llm(base_dir, max_lora_rank=8)
    with pytest.raises(LoRAFileError, match="rank is 64, above --max-lora-rank 8"):
        llm.generate([[1, 2]], lora_request=adapters[1])
    wide = make_tiny_llama(tmp_path / "wide", hidden_size=96, vocab_size=259)
    other = make_peft_adapter(wide, tmp_path / "other", rank=8, seed=1)
    with pytest.raises(LoRAFileError,
                       match=r"B \[96, 8\] do not fit the model.s 128 -> 64 projection"):
        llm.generate([[1, 2]], lora_request=LoRARequest(lora_name="x", lora_int_id=9,
                                                        lora_path=str(other)))
    config = json.loads((other / "adapter_config.json").read_text())
    (other / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(LoRAFileError, match="use_dora is not supported"):
        llm.generate([[1, 2]], lora_request=LoRARequest(lora_name="y", lora_int_id=10,
                                                        lora_path=str(other)))
    off = LLM(model=str(base_dir), in_process=True, dtype="float32", kv_cache_memory="8MiB",
              block_size=8, swap_space=0.0)
    with pytest.raises(ValueError, match="LoRA is disabled"):
        off.generate([[1, 2]], lora_request=adapters[0])
    with pytest.raises(RequestError, match="LoRA is disabled"):
        off._core.generate([([1, 2], SamplingParams(max_tokens=2), adapters[0])])
