"""PAGEDSERVE_STEP_TRACE on a launched group: every step's time split into schedule, send,
rank 0's forward (matmul, attention, other) and sample, return and update by the scheduler, and
queue and detokenize by the detokenizer; scripts/step_budget.py sums a single stream's token."""
from __future__ import annotations

import json
import statistics

from pagedserve.pipeline import LLM, SamplingParams
from script_module import load_script

PHASES = ("schedule_ms", "send_ms", "forward_ms", "matmul_ms", "attention_ms", "other_ms",
          "sample_ms", "return_ms", "update_ms", "round_trip_ms")


def test_the_trace_splits_each_step_across_the_processes(model_dir, tmp_path, monkeypatch):
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv("PAGEDSERVE_STEP_TRACE", str(trace))
    with LLM(model=str(model_dir), kv_cache_memory="64MiB", cpu_threads=1) as llm:
        [out] = llm.generate(["def fibonacci(n):"], SamplingParams(max_tokens=12,
                                                                   temperature=0.0,
                                                                   ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 12
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    steps = [r for r in lines if r["role"] == "scheduler"]
    detok = {r["step"]: r for r in lines if r["role"] == "detokenizer"}
    assert len(steps) == 12 and set(detok) == {r["step"] for r in steps}
    for r in steps:
        assert all(r[k] >= 0 for k in PHASES if k != "other_ms"), r
        # the worker's parts fit in its forward, which fits in the round trip with the hops
        assert r["matmul_ms"] + r["attention_ms"] <= r["forward_ms"] + 1e-3, r
        assert r["send_ms"] + r["forward_ms"] + r["sample_ms"] + r["return_ms"] \
            <= r["round_trip_ms"] + 0.01, r
        assert r["matmul_ms"] > 0 and r["attention_ms"] > 0
        assert detok[r["step"]]["queue_ms"] >= 0 and detok[r["step"]]["detokenize_ms"] > 0
    summary = load_script("step_budget").budget(lines)
    assert summary["steps"] == 11  # the decodes after the prompt's step
    # overlapped scheduling: most decodes were planned while the one before computed; a
    # token's time is the median step's sequential phases, only rank 0's for those
    ahead = [r for r in steps if r["ahead"]]
    assert summary["ahead_steps"] == len(ahead) >= 5
    decodes = [r | detok[r["step"]] for r in steps if r["prefill_tokens"] == 0]
    assert summary["token_ms"] == round(statistics.median(sum(r[k] for k in (
        ("send_ms", "forward_ms", "sample_ms") if r["ahead"] else (
            "schedule_ms", "send_ms", "forward_ms", "sample_ms", "return_ms", "update_ms",
            "queue_ms", "detokenize_ms"))) for r in decodes), 3)
