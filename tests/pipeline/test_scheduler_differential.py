"""The one-rule scheduler against the scheduler it replaced (old_scheduler.py loads that one
from git history): the same randomized workloads - arrivals, aborts, stop strings, logprobs,
priorities, n > 1, swap and recompute, prefix caching, chunking, sliding windows, n-gram drafts
- give the same plans, outputs, block tables and pool counts at every step."""
from dataclasses import astuple
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import old_scheduler
from pagedserve.kvmanager import KVCacheManager
from pagedserve.pipeline.sampling_params import SamplingParams as SP
from pagedserve.pipeline.scheduler import RequestRejected, Scheduler, SchedulerConfig
from pagedserve.pipeline.scheduler.sequence import Request
from pagedserve.pipeline.speculative_config import SpeculativeConfig
from sched_fakes import FakeWorker, copying_next_token, window_next_token
from test_scheduler_lane_equivalence import block_tables, canonical_outputs, canonical_plan
from test_scheduler_property import BLOCK, EOS, VOCAB, _prompt, config_st, request_st

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def old(tmp_path_factory):
    package = old_scheduler.load(REPO, tmp_path_factory.mktemp("old"))
    if isinstance(package, str):
        pytest.skip(package)
    return package


def with_logprobs(result):
    """The same result with logprobs attached: the samples take the one-by-one paths."""
    return msgspec.structs.replace(
        result, logprobs=[-t / 100 for t in result.token_ids],
        top_logprobs=[[(t, -t / 100)] for t in result.token_ids])


def _config(cfg, window: int) -> dict:
    max_model_len = 48
    budget = cfg["max_num_seqs"] + cfg["extra_budget"]
    if not cfg["enable_chunked_prefill"]:
        budget = max(budget, max_model_len)
    spec = cfg.get("speculative")
    return dict(
        block_size=BLOCK, max_model_len=max_model_len, max_num_seqs=cfg["max_num_seqs"],
        max_num_batched_tokens=budget, enable_chunked_prefill=cfg["enable_chunked_prefill"],
        enable_prefix_caching=cfg["enable_prefix_caching"], policy=cfg["policy"],
        preemption_mode=cfg["preemption_mode"], swap_threshold_tokens=cfg["swap_threshold_tokens"],
        watermark=cfg["watermark"], max_queued_requests=10, sliding_window=window,
        speculative=SpeculativeConfig("ngram", *spec) if spec else None)


def _pair(old, cfg, window):
    """(scheduler, its fake worker, its Request type) for the old and the new code."""
    settings_ = _config(cfg, window)
    model = copying_next_token if cfg.get("speculative") else window_next_token
    sides = []
    for scheduler_cls, config_cls, request_cls in (
            (old.Scheduler, old.SchedulerConfig, old.sequence.Request),
            (Scheduler, SchedulerConfig, Request)):
        config = config_cls(**settings_)
        kv = KVCacheManager(cfg["num_gpu_blocks"], BLOCK, cfg["num_cpu_blocks"],
                            enable_prefix_caching=config.enable_prefix_caching,
                            watermark=config.watermark, sliding_window=window)
        worker = FakeWorker(cfg["num_gpu_blocks"], cfg["num_cpu_blocks"], BLOCK, VOCAB,
                            window=window, model=model)
        sides.append((scheduler_cls(config, kv, (EOS,)), worker, request_cls))
    return sides


def run_both(old, cfg, specs, logprob_every, stop_every, window=0) -> int:
    sides = _pair(old, cfg, window)
    arrivals, aborts = {}, {}
    for i, spec in enumerate(specs):
        params = SP(max_tokens=spec["max_tokens"],
                    min_tokens=min(spec["min_tokens"], spec["max_tokens"]),
                    ignore_eos=spec["ignore_eos"], n=spec["n"])
        arrivals.setdefault(spec["arrival"], []).append(
            (f"r{i}", _prompt(i, spec), params, float(spec["arrival"] * 100 + i), spec["priority"]))
        if spec["abort_at"] is not None:
            aborts.setdefault(spec["abort_at"], []).append(f"r{i}")
    for step_no in range(3000):
        for rid, prompt, params, arrival, priority in arrivals.pop(step_no, []):
            rejected = set()
            for sched, _, request_cls in sides:
                try:
                    sched.add(request_cls(rid, list(prompt), params, arrival, priority))
                    rejected.add(None)
                except (RequestRejected, old.RequestRejected) as exc:
                    rejected.add(str(exc))
            assert len(rejected) == 1, rejected
        for rid in aborts.pop(step_no, []):
            outs = [canonical_outputs(sched.abort(rid)) for sched, _, _ in sides]
            assert outs[0] == outs[1]
        if not sides[0][0].has_unfinished() and not arrivals:
            assert not sides[1][0].has_unfinished()
            return step_no
        plans = [sched.schedule(float(step_no)) for sched, _, _ in sides]
        assert canonical_plan(plans[0]) == canonical_plan(plans[1]), step_no
        assert plans[0].decode_seq_ids == plans[1].decode_seq_ids, step_no
        results = [worker.execute(plan) for (_, worker, _), plan in zip(sides, plans)]
        if logprob_every and step_no % logprob_every == logprob_every - 1:
            results = [with_logprobs(r) for r in results]
        if stop_every and step_no % stop_every == stop_every - 1:
            live = sorted(sides[0][0].requests)
            if live:
                outs = [canonical_outputs(sched.stop(live[0], "stop", 0)) for sched, _, _ in sides]
                assert outs[0] == outs[1]
        outs = [canonical_outputs(sched.update(plan, result, float(step_no)))
                for (sched, _, _), plan, result in zip(sides, plans, results)]
        assert outs[0] == outs[1], step_no
        assert block_tables(sides[0][0]) == block_tables(sides[1][0]), step_no
        assert sides[0][0].kv.stats() == sides[1][0].kv.stats(), step_no
        assert astuple(sides[0][0].stats()) == astuple(sides[1][0].stats()), step_no
    raise AssertionError("not done after 3000 steps")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=config_st, specs=st.lists(request_st, min_size=1, max_size=14),
       logprob_every=st.sampled_from([0, 0, 3, 5]), stop_every=st.sampled_from([0, 0, 4, 9]),
       window=st.sampled_from([0, 0, 0, 4, 9]))
def test_the_one_rule_plans_what_the_old_phases_planned(old, cfg, specs, logprob_every,
                                                       stop_every, window):
    if window and cfg.get("speculative"):
        cfg = {**cfg, "speculative": None}  # drafts are refused under a sliding window
    run_both(old, cfg, specs, logprob_every, stop_every, window)


def test_a_busy_workload_runs_many_steps_through_both(old):
    """The comparison above is not vacuous: a workload with preemptions, forks and drafts."""
    cfg = dict(num_gpu_blocks=12, num_cpu_blocks=8, max_num_seqs=4, extra_budget=6,
               enable_chunked_prefill=True, enable_prefix_caching=True, policy="priority",
               preemption_mode="auto", swap_threshold_tokens=10, watermark=0.0,
               speculative=(3, 1, 2))
    specs = [dict(arrival=i // 2, prefix=i % 3, prompt_len=4 + 3 * i, max_tokens=12,
                  min_tokens=0, ignore_eos=i % 2 == 0, priority=i % 3, n=1 + (i == 3),
                  abort_at=9 if i == 5 else None) for i in range(10)]
    assert run_both(old, cfg, specs, logprob_every=0, stop_every=0) > 30
