"""A worker killed while LoRA requests run: the restarted worker loads their adapters again from
what the scheduler sends with each sequence (NewSeq.lora), and every stream ends with the tokens
transformers + peft give, as if nothing had happened (launched group, tiny random Llama)."""
from __future__ import annotations

from faults.conftest import Group
from pagedserve.pipeline.ingress.testing import make_tiny_tokenizer
from pagedserve.pipeline.lora_request import LoRARequest
from pagedserve.pipeline.sampling_params import SamplingParams
from pagedserve.workers.lora.testing import make_peft_adapter, peft_greedy
from pagedserve.workers.testing import make_tiny_llama

TOKENS = 16


def test_adapters_are_reloaded_after_a_worker_restart(tmp_path):
    base = make_tiny_llama(tmp_path / "base", seed=5, vocab_size=259)
    make_tiny_tokenizer().save_pretrained(base)
    loras = [LoRARequest(lora_name=f"a{i}", lora_int_id=10 + i, lora_path=str(
        make_peft_adapter(base, tmp_path / f"a{i}", rank=8, seed=i))) for i in range(2)]
    group = Group(base, fault="worker0:crash@step=6",
                  extra=("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"))
    try:
        prompts = [[7, 8, 9, 10], [7, 8, 9, 10], [30, 31, 32]]
        params = SamplingParams(max_tokens=TOKENS, ignore_eos=True, temperature=0.0)
        futures = [group.client.submit(p, params, lora=lora)
                   for p, lora in zip(prompts, [*loras, None])]
        outputs = [f.result(timeout=300) for f in futures]
        assert group.restarts()["worker"] == 1
    finally:
        group.close()
    for prompt, lora, out in zip(prompts, [*loras, None], outputs):
        want = peft_greedy(base, lora.lora_path if lora else None, prompt, TOKENS)
        assert out.outputs[0].token_ids == want, lora
