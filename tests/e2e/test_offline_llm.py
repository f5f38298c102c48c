"""The offline API against real process groups (scheduler, workers, detokenizer)."""
from __future__ import annotations

import multiprocessing as mp
import time

import psutil
import pytest

from pagedserve.pipeline import LLM, SamplingParams
from e2e.conftest import our_processes, shm_segments
from pagedserve.workers.testing import hf_greedy

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "A haiku about the sea:",
    "import numpy as np\nx = np.arange(10)\n",
    "Question: What is 12 times 12?\nAnswer:",
]


def test_tp2_greedy_equals_transformers_reference(model_dir, tokenizer):
    prompts = PROMPTS[:4]       # a batch of 4, 16 tokens: two ranks on 2 cores are slow
    ids = [tokenizer.encode(p) for p in prompts]
    expected = hf_greedy(model_dir, ids, max_new_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with LLM(model=str(model_dir), tensor_parallel_size=2, dtype="float32",
             quantization="none", kv_cache_memory="256MiB") as llm:
        launcher = psutil.Process(llm._group.proc.pid)
        roles = [" ".join(c.cmdline()) for c in launcher.children()]
        # scheduler, 2 workers, detokenizer (+ this test process as the client)
        assert sum("pagedserve.workers.process" in r for r in roles) == 2
        assert sum("pagedserve.pipeline.scheduler.process" in r for r in roles) == 1
        assert sum("pagedserve.pipeline.detokenizer.process" in r for r in roles) == 1
        outs = llm.generate(ids, params)
        # decode steps planned ahead: rank 1 took rank 0's samples by broadcast
        assert llm.stats()["steps_planned_ahead"] > 0
    for out, exp, prompt in zip(outs, expected, prompts):
        assert out.outputs[0].token_ids == exp, prompt
        assert out.outputs[0].finish_reason == "length"
        assert out.outputs[0].text == tokenizer.decode(exp, skip_special_tokens=True)


def test_the_in_process_engine_overlaps_and_decodes_as_the_group(model_dir, tokenizer):
    """EngineCore runs the scheduler process's StepLoop: with async scheduling (the default)
    it plans steps ahead as the group does and gives the group's greedy tokens."""
    ids = [tokenizer.encode(p) for p in PROMPTS[4:6]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    settings = dict(model=str(model_dir), dtype="float32", quantization="none",
                    kv_cache_memory="128MiB", swap_space=0.0)
    outputs = {}
    for in_process in (True, False):
        with LLM(in_process=in_process, **settings) as llm:
            outputs[in_process] = [o.outputs[0].token_ids for o in llm.generate(ids, params)]
            assert llm.stats()["steps_planned_ahead"] > 0, in_process
    assert outputs[True] == outputs[False] == hf_greedy(model_dir, ids, max_new_tokens=16)


def in_process_greedy(model_dir, prompts: list[list[int]], max_new_tokens: int,
                      quantization: str) -> list[list[int]]:
    """Greedy decode in this process, batched as the scheduler batches these few short prompts:
    one step prefills them all, then each step decodes one token for each."""
    import torch

    from pagedserve.workers.loader import load_config
    from pagedserve.workers.model_runner import ModelRunner, SeqStep
    per_seq = -(-(max(map(len, prompts)) + max_new_tokens) // 16)
    runner = ModelRunner(load_config(model_dir), model_dir, torch.float32, "cpu", 16,
                         per_seq * len(prompts), quantization=quantization)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    outputs: list[list[int]] = [[] for _ in prompts]
    items = [SeqStep(p, 0, t, True) for p, t in zip(prompts, tables)]
    for _ in range(max_new_tokens):
        for out, row in zip(outputs, runner.execute(items).argmax(-1).tolist()):
            out.append(row)
        items = [SeqStep([out[-1]], len(p) + len(out) - 1, t, True)
                 for p, out, t in zip(prompts, outputs, tables)]
    return outputs


def test_int8_group_greedy_equals_the_in_process_int8_model(model_dir, tokenizer):
    # --quantization reaches the worker: the group decodes what the int8 model does here
    ids = [tokenizer.encode(p) for p in PROMPTS[:4]]
    expected = in_process_greedy(model_dir, ids, 16, "int8")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with LLM(model=str(model_dir), quantization="int8", kv_cache_memory="128MiB",
             swap_space=0.1) as llm:
        outs = llm.generate(ids, params)
    assert [out.outputs[0].token_ids for out in outs] == expected
    assert expected != in_process_greedy(model_dir, ids, 16, "none")   # int8 is really on


def test_generate_returns_outputs_in_input_order_with_text_prompts(llm_bf16, model_dir):
    params = [SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True) for k in (3, 9, 1, 5)]
    outs = llm_bf16.generate(PROMPTS[:4], params)
    assert [o.prompt for o in outs] == PROMPTS[:4]
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 9, 1, 5]
    # the fixture's fp8 cache: one byte per element, so 512 MiB holds that many blocks
    from pagedserve.workers.kv_cache import num_blocks_for_bytes
    import torch
    from pagedserve.workers.loader import load_config
    config = load_config(model_dir)
    assert llm_bf16.stats()["kv_blocks_total"] == num_blocks_for_bytes(
        config, 16, torch.float8_e4m3fn, 512 << 20)


def _client_process(frontend, output, n, offset, queue):
    from pagedserve.pipeline.client import EngineClient
    with EngineClient(frontend, output) as client:
        futs = [client.submit([1 + (i % 50), 2, 3, 4 + i % 7],
                              SamplingParams(temperature=0.8, seed=i, max_tokens=4 + (i + offset) % 13,
                                             ignore_eos=True))
                for i in range(n)]
        queue.put([len(f.result().outputs[0].token_ids) for f in futs])


def test_256_concurrent_requests_from_two_client_processes(llm_bf16):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    g = llm_bf16._group
    procs = [ctx.Process(target=_client_process, args=(g.frontend_addr, g.output_addr, 128, k * 128, q))
             for k in range(2)]
    for p in procs:
        p.start()
    lengths = sorted(q.get(timeout=600) + q.get(timeout=600))
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    want = sorted(4 + (i + k * 128) % 13 for k in range(2) for i in range(128))
    assert lengths == want
    stats = llm_bf16.stats()
    assert stats["num_requests_running"] == 0 and stats["kv_blocks_used"] == 0


def test_abort_mid_stream_frees_blocks_within_a_step(llm_bf16):
    client = llm_bf16.client
    params = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)
    streams = [client.generate([5, 6, 7, 8 + i], params, request_id=f"abort-{i}") for i in range(50)]
    for s in streams:
        next(s)  # every request has produced its first token
    assert llm_bf16.stats()["kv_blocks_used"] > 0
    for s in streams:
        s.close()  # closing a stream aborts its request
    deadline = time.monotonic() + 10
    while llm_bf16.stats()["kv_blocks_used"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert llm_bf16.stats()["kv_blocks_used"] == 0


def test_stop_strings_end_and_are_trimmed(llm_bf16, tokenizer):
    base = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    full = llm_bf16.generate([PROMPTS[2]], base)[0].outputs[0]
    ids = full.token_ids
    # a stop string spanning the boundary between two generated tokens
    a, b = tokenizer.decode(ids[:5]), tokenizer.decode(ids[:7])
    stop = b[len(a) - 2:]
    assert len(stop) >= 3
    text_before = full.text[: full.text.index(stop)]
    out = llm_bf16.generate([PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=40,
                                                         ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert out.text == text_before
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_emoji_and_cjk_streams_equal_full_decode(llm_bf16, tokenizer):
    prompts = ["用中文写一首关于大海的诗：", "Reply with only emoji: 🎉🚀🔥", "日本語で自己紹介してください。"]
    outs = llm_bf16.generate(prompts, SamplingParams(temperature=0.7, seed=3, max_tokens=48,
                                                     ignore_eos=True))
    for o in outs:
        assert o.outputs[0].text == tokenizer.decode(o.outputs[0].token_ids, skip_special_tokens=True)


def test_idle_group_uses_almost_no_cpu(llm_bf16):
    """Once its one-time work is done: the grammar tables and the compile process the scheduler
    starts after 10 s idle."""
    deadline = time.monotonic() + 120
    while not llm_bf16.stats()["grammar_compiler_warm"]:
        assert time.monotonic() < deadline, "the idle scheduler never warmed its grammar compiler"
        time.sleep(0.2)
    launcher = psutil.Process(llm_bf16._group.proc.pid)
    procs = [launcher] + launcher.children(recursive=True)
    time.sleep(1.0)
    before = sum(p.cpu_times().user + p.cpu_times().system for p in procs)
    time.sleep(5.0)
    after = sum(p.cpu_times().user + p.cpu_times().system for p in procs)
    assert (after - before) / 5.0 < 0.02


def test_sigterm_drains_in_flight_requests_and_leaves_nothing(model_dir):
    import signal
    llm = LLM(model=str(model_dir), kv_cache_memory="128MiB", swap_space=0.1)
    ipc_dir = llm._group.ipc_dir
    futs = [llm.client.submit([1, 2, 3, i], SamplingParams(max_tokens=30, ignore_eos=True)) for i in range(8)]
    time.sleep(0.5)
    llm._group.proc.send_signal(signal.SIGTERM)
    outs = [f.result(timeout=120) for f in futs]
    assert all(len(o.outputs[0].token_ids) == 30 for o in outs)
    assert llm._group.proc.wait(60) == 0
    llm.close()
    import os
    assert not os.path.exists(ipc_dir)
    assert not shm_segments(os.path.basename(ipc_dir))
    assert not [p for p in our_processes() if ipc_dir in " ".join(p.cmdline())]
