"""Property test: random arrivals, lengths, aborts, priorities, n, n-gram speculation and a small
pool. Every accepted request finishes (with exactly the tokens an undisturbed run gives) or is
aborted; no deadlock; budget and caps hold every step; the pools are empty at the end."""
import os

from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from pagedserve.pipeline.sampling_params import SamplingParams as SP
from pagedserve.pipeline.scheduler import RequestRejected
from pagedserve.pipeline.scheduler.sequence import Request
from pagedserve.pipeline.speculative_config import SpeculativeConfig
from sched_fakes import copying_next_token, expected_tokens, make_scheduler, window_next_token

EOS = 7
VOCAB = 40
BLOCK = 4

request_st = st.fixed_dictionaries({
    "arrival": st.integers(0, 25),
    "prefix": st.integers(0, 2),  # shared prefixes exercise the prefix cache
    "prompt_len": st.integers(1, 24),
    "max_tokens": st.integers(1, 12),
    "min_tokens": st.integers(0, 3),
    "ignore_eos": st.booleans(),
    "priority": st.integers(0, 3),
    "n": st.sampled_from([1, 1, 1, 2, 3]),
    "abort_at": st.one_of(st.none(), st.integers(0, 40)),
})

config_st = st.fixed_dictionaries({
    "num_gpu_blocks": st.integers(8, 24),
    "num_cpu_blocks": st.sampled_from([0, 4, 16]),
    "max_num_seqs": st.integers(1, 6),
    "extra_budget": st.integers(0, 24),
    "enable_chunked_prefill": st.booleans(),
    "enable_prefix_caching": st.booleans(),
    "policy": st.sampled_from(["fcfs", "priority"]),
    "preemption_mode": st.sampled_from(["swap", "recompute", "auto"]),
    "swap_threshold_tokens": st.sampled_from([None, 10]),
    "watermark": st.sampled_from([0.0, 0.1]),
    # (num_speculative_tokens, prompt_lookup_min, prompt_lookup_max); the fake model copies
    # when speculating, so drafts are often accepted
    "speculative": st.sampled_from([None, None, (3, 1, 2), (5, 2, 3)]),
})


def _prompt(i, spec):
    prefix = [[11, 12, 13, 14, 15, 16, 17, 18], [21, 22, 23, 24, 25], []][spec["prefix"]]
    return (prefix + [(i * 7 + j) % 30 + 8 for j in range(spec["prompt_len"])])[:32]


# Found by Hypothesis: a parent swapped out before its n samples forked came back with room
# for one sequence only and overshot max_num_seqs when it forked.
_SWAPPED_PARENT_CFG = dict(num_gpu_blocks=8, num_cpu_blocks=4, max_num_seqs=4, extra_budget=0,
                           enable_chunked_prefill=True, enable_prefix_caching=False, policy="fcfs",
                           preemption_mode="swap", swap_threshold_tokens=None, watermark=0.0)


def _spec(prompt_len, max_tokens, n=1, arrival=0, priority=0):
    return dict(arrival=arrival, prefix=0, prompt_len=prompt_len, max_tokens=max_tokens,
                min_tokens=0, ignore_eos=False, priority=priority, n=n, abort_at=None)


_SWAPPED_PARENT_SPECS = [_spec(2, 1), *[_spec(1, 1)] * 6, _spec(1, 1, priority=1), _spec(10, 4),
                         _spec(1, 1, n=3), _spec(1, 1), _spec(1, 1, n=2, arrival=1)]


# Found by Hypothesis: a block holding only draft slots (reserved, not computed) was taken as
# full at a swap-out, so its host copy stayed linked; the sequence's real tokens then wrote the
# device block, and the next swap-out reused the stale copy: a rejected draft's KV came back.
_DRAFT_SLOTS_CFG = dict(num_gpu_blocks=11, num_cpu_blocks=16, max_num_seqs=2, extra_budget=0,
                        enable_chunked_prefill=False, enable_prefix_caching=False,
                        policy="priority", preemption_mode="swap", swap_threshold_tokens=None,
                        watermark=0.0, speculative=(5, 2, 3))
_DRAFT_SLOTS_SPECS = [*[_spec(1, 1)] * 4, _spec(17, 9, n=2, priority=1), _spec(1, 1),
                      _spec(1, 1, arrival=4), _spec(1, 5, arrival=15)]


@example(cfg=_SWAPPED_PARENT_CFG, specs=_SWAPPED_PARENT_SPECS)
@example(cfg=_DRAFT_SLOTS_CFG, specs=_DRAFT_SLOTS_SPECS)
@settings(max_examples=int(os.environ.get("SCHED_PROPERTY_EXAMPLES", "120")), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=config_st, specs=st.lists(request_st, min_size=1, max_size=14))
def test_random_workloads_finish(cfg, specs):
    max_model_len = 48
    budget = cfg["max_num_seqs"] + cfg["extra_budget"]
    if not cfg["enable_chunked_prefill"]:
        budget = max(budget, max_model_len)
    spec = cfg.get("speculative")
    model = copying_next_token if spec else window_next_token
    sched, worker = make_scheduler(
        cfg["num_gpu_blocks"], cfg["num_cpu_blocks"], eos=(EOS,), vocab=VOCAB, model=model,
        speculative=SpeculativeConfig("ngram", *spec) if spec else None,
        block_size=BLOCK, max_model_len=max_model_len, max_num_seqs=cfg["max_num_seqs"],
        max_num_batched_tokens=budget, enable_chunked_prefill=cfg["enable_chunked_prefill"],
        enable_prefix_caching=cfg["enable_prefix_caching"], policy=cfg["policy"],
        preemption_mode=cfg["preemption_mode"], swap_threshold_tokens=cfg["swap_threshold_tokens"],
        watermark=cfg["watermark"], max_queued_requests=10)
    arrivals, aborts, want = {}, {}, {}
    for i, spec in enumerate(specs):
        prompt = _prompt(i, spec)
        params = SP(max_tokens=spec["max_tokens"], min_tokens=min(spec["min_tokens"],
                                                                  spec["max_tokens"]),
                    ignore_eos=spec["ignore_eos"], n=spec["n"])
        arrivals.setdefault(spec["arrival"], []).append(
            Request(f"r{i}", prompt, params, arrival_time=float(spec["arrival"] * 100 + i),
                    priority=spec["priority"]))
        if spec["abort_at"] is not None:
            aborts.setdefault(spec["abort_at"], []).append(f"r{i}")
        stop_ids = () if spec["ignore_eos"] else (EOS,)
        want[f"r{i}"] = (expected_tokens(prompt, params.max_tokens, VOCAB, 0, stop_ids,
                                         params.min_tokens, model=model),
                         stop_ids, params.min_tokens, params.n)
    accepted, aborted = set(), set()
    swapped = copied = False
    tokens, reasons = {}, {}
    for step_no in range(3000):
        for req in arrivals.pop(step_no, []):
            try:
                sched.add(req)
                accepted.add(req.request_id)
            except RequestRejected as exc:
                assert any(cause in str(exc) for cause in
                           ("max_queued_requests", "usable blocks", "max_num_seqs"))
        for rid in aborts.pop(step_no, []):
            if rid in sched.requests:
                aborted.add(rid)
            for out in sched.abort(rid):
                reasons.setdefault(rid, {})[out.index] = out.finish_reason
        if not sched.has_unfinished() and not arrivals:
            break
        plan = sched.schedule(float(step_no))
        swapped |= bool(plan.swap_out)
        copied |= bool(plan.copy)
        num_tokens = [s.num_tokens + len(s.draft_token_ids) for s in plan.seq_steps()]
        assert sum(num_tokens) <= budget and min(num_tokens, default=1) >= 1
        assert len(plan.seq_steps()) <= cfg["max_num_seqs"]
        assert sched.num_running + sched.num_unforked <= cfg["max_num_seqs"]
        assert len({s.seq_id for s in plan.seq_steps()}) == len(plan.seq_steps())
        if not cfg["enable_chunked_prefill"]:
            for new in plan.new_seqs:  # whole prompts only
                s = next(s for s in plan.seq_steps() if s.seq_id == new.seq_id)
                total = len(new.prompt_token_ids) + len(new.output_token_ids)
                assert new.num_computed_tokens + s.num_tokens in (total, new.num_computed_tokens)
        for out in sched.update(plan, worker.execute(plan), float(step_no)):
            tokens.setdefault(out.request_id, {}).setdefault(out.index, []).extend(
                out.new_token_ids)
            if out.finish_reason is not None:
                reasons.setdefault(out.request_id, {})[out.index] = out.finish_reason
    else:
        raise AssertionError(f"deadlock: {sched.stats()}")
    event(f"preempted: {sched.num_preemptions > 0}")
    event(f"swapped: {swapped}")
    event(f"copy-on-write: {copied}")
    event(f"prefix hits: {sched.stats().prefix_cache_hits > 0}")
    if spec:
        drafted = sum(d for d, _ in worker.verified)
        taken = sum(a for _, a in worker.verified)
        event(f"drafts accepted: {'none' if not taken else 'all' if taken == drafted else 'some'}")
        assert (sched.spec_draft_tokens, sched.spec_accepted_tokens) == (drafted, taken)
    assert not sched.has_unfinished() and not sched.seqs
    kv = sched.kv.stats()
    assert (kv.gpu_blocks_used, kv.cpu_blocks_used) == (0, 0)
    stats = sched.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_swapped) == (0, 0, 0)
    for rid in accepted - aborted:
        expected, stop_ids, min_tokens, n = want[rid]
        assert set(tokens[rid]) == set(reasons[rid]) == set(range(n))  # every sample finished
        for index, got in tokens[rid].items():
            assert got == expected, (rid, index)  # the same tokens however often preempted
            stopped = got[-1] in stop_ids and len(got) >= min_tokens
            assert reasons[rid][index] == ("stop" if stopped else "length")
    for rid in aborted:
        assert "abort" in reasons[rid].values()
