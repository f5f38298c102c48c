"""Real checkpoints kept quantized (#21): SmolLM2-135M (Q4_1) and Qwen2.5-Coder-0.5B (Q4_K_M)
multiplied in their GGUF block formats by the native kernels, teacher-forced on 24 ShareGPT first
turns: perplexity within 1% of the same file dequantized to fp32; greedy tokens equal to a torch
implementation of the same quantized arithmetic (bit for bit: native_linear_gguf.linear_exact_ref); and the worker's memory: the file's bytes, the
KV cache and little else."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from itertools import islice

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels import native_linear_gguf as gl
from pagedserve.pipeline.tokenizer import load_tokenizer
from pagedserve.workers.gguf_files import gguf_source
from pagedserve.workers.loader import load_config, resolve_model
from pagedserve.workers.model_runner import ModelRunner, SeqStep
from pagedserve.workers.models.quantized import QuantizedMatmul
from test_model import all_row_logits

from script_module import load_script

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not gl.available(),
                                                   reason="native kernels unavailable")]
BLOCK_SIZE = 16
TEXT_TOKENS = 64          # each first turn (prompt and reply) cut to its first 64 tokens
MODELS = [("SmolLM2-135M-Instruct", {"Q4_1": 210, "Q8_0": 1}),
          ("Qwen2.5-Coder-0.5B-Instruct", {"Q5_0": 133, "Q8_0": 13, "Q6_K": 12, "Q4_K": 12})]


@pytest.fixture(scope="module")
def sharegpt_turns() -> list[str]:
    turns = load_script("sharegpt").first_turns()
    return [f"{human}\n{reply}" for human, reply in islice(
        (t for t in turns if len(t[0]) + len(t[1]) > 400), 24)]


def runner(model_dir, quantization: str, blocks: int = TEXT_TOKENS // BLOCK_SIZE) -> ModelRunner:
    return ModelRunner(load_config(model_dir), model_dir, torch.float32, "cpu", BLOCK_SIZE, blocks,
                       quantization=quantization)


def nll(run: ModelRunner, tokens: list[int]) -> float:
    logits, _ = all_row_logits(run, [SeqStep(tokens, 0, list(range(len(tokens) // BLOCK_SIZE + 1)),
                                             True)])
    return float(F.cross_entropy(logits[:-1].float(), torch.tensor(tokens[1:]), reduction="sum"))


@pytest.mark.parametrize("name,types", MODELS, ids=[m[0] for m in MODELS])
def test_perplexity_within_one_percent_of_the_dequantized_file(name, types, sharegpt_turns):
    model_dir = resolve_model(name)
    tokenizer = load_tokenizer(model_dir)
    texts = [tokenizer.encode(text)[:TEXT_TOKENS] for text in sharegpt_turns]
    quant = runner(model_dir, "gguf")
    kept = [m.quantized for m in quant.model.modules() if getattr(m, "quantized", None)]
    kept_types: dict[str, int] = {}
    for matmul in kept:
        for _, w in matmul.segments:
            kept_types[w.qtype.name] = kept_types.get(w.qtype.name, 0) + 1
    assert set(kept_types) == set(types)    # every type of the file multiplied as stored
    q_total = sum(nll(quant, tokens) for tokens in texts)
    del quant
    exact = runner(model_dir, "none")
    e_total = sum(nll(exact, tokens) for tokens in texts)
    count = sum(len(tokens) - 1 for tokens in texts)
    ppl_q, ppl_e = math.exp(q_total / count), math.exp(e_total / count)
    print(f"{name}: perplexity fp32 {ppl_e:.4f}, kept quantized {ppl_q:.4f} "
          f"({100 * (ppl_q / ppl_e - 1):+.3f}%) over {count} tokens")
    assert abs(ppl_q / ppl_e - 1) < 0.01, (ppl_e, ppl_q)


def _reference_call(cache: dict):
    """QuantizedMatmul.__call__ in torch, bit for bit the kernel's arithmetic
    (native_linear_gguf.linear_exact_ref; each weight unpacked once, into bf16, which holds its
    small integers exactly)."""
    def call(self: QuantizedMatmul, x: torch.Tensor) -> torch.Tensor:
        outs = []
        for _, w in self.segments:
            unpacked = cache.get(id(w))
            if unpacked is None:
                u, sc, mc, d, dm = gl.unpack_ref(w)
                unpacked = cache[id(w)] = (u.to(torch.bfloat16), sc.to(torch.int16),
                                           mc.to(torch.int16), d, dm)
            outs.append(gl.linear_exact_ref(x, w, unpacked))
        return torch.cat(outs, dim=1)
    return call


def greedy(run: ModelRunner, prompt: list[int], new_tokens: int) -> list[int]:
    table = list(range(run.num_blocks))
    logits = run.execute([SeqStep(prompt, 0, table, True)])
    out = [int(logits[0].argmax())]
    for i in range(new_tokens - 1):
        logits = run.execute([SeqStep([out[-1]], len(prompt) + i, table, True)])
        out.append(int(logits[0].argmax()))
    return out


@pytest.mark.parametrize("name", ["SmolLM2-135M-Instruct"])   # Qwen's types: the kernel tests
def test_greedy_tokens_equal_torch_doing_the_same_quantized_arithmetic(name, sharegpt_turns,
                                                                      monkeypatch):
    model_dir = resolve_model(name)
    tokenizer = load_tokenizer(model_dir)
    prompts = [tokenizer.encode(text)[:16] for text in sharegpt_turns[:1]]
    run = runner(model_dir, "gguf", blocks=2)
    native = [greedy(run, prompt, 4) for prompt in prompts]
    monkeypatch.setattr(QuantizedMatmul, "__call__", _reference_call({}))
    assert [greedy(run, prompt, 4) for prompt in prompts] == native


def test_the_worker_holds_the_file_the_cache_and_little_else():
    """A process that loads Qwen2.5-Coder-0.5B's Q4_K_M kept quantized, as a worker does: what
    loading adds to its memory is at most the file's size + the KV cache + 300 MB, and the peak
    during loading at most 1.5x the final footprint. Never a dequantized copy on disk."""
    model_dir = resolve_model("Qwen2.5-Coder-0.5B-Instruct")
    assert not list(model_dir.glob("*.safetensors"))
    script = textwrap.dedent(f"""
        import json, torch
        from pagedserve.workers.loader import load_config
        from pagedserve.workers.model_runner import ModelRunner, SeqStep
        def status():
            return {{k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1)
                    for line in open("/proc/self/status")) if k in ("VmRSS", "VmHWM")}}
        config = load_config({str(model_dir)!r})
        before = status()
        run = ModelRunner(config, {str(model_dir)!r}, torch.float32, "cpu", 16, 256,
                          kv_cache_dtype=torch.bfloat16, quantization="gguf")
        run.execute([SeqStep(list(range(100, 164)), 0, [0, 1, 2, 3, 4], True)])
        after = status()
        print(json.dumps({{"before": before, "after": after,
                          "kv": run.kv_cache.numel() * run.kv_cache.element_size()}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    figures = json.loads(out.strip().splitlines()[-1])
    file_bytes = gguf_source(model_dir).stat().st_size
    added = figures["after"]["VmRSS"] - figures["before"]["VmRSS"]
    print(f"RSS {figures['before']['VmRSS'] / 2**20:.0f} MiB before loading, "
          f"{figures['after']['VmRSS'] / 2**20:.0f} after (file {file_bytes / 2**20:.0f}, "
          f"KV {figures['kv'] / 2**20:.0f}), peak {figures['after']['VmHWM'] / 2**20:.0f}")
    assert added <= file_bytes + figures["kv"] + 300 * 2**20
    assert figures["after"]["VmHWM"] <= 1.5 * figures["after"]["VmRSS"]
