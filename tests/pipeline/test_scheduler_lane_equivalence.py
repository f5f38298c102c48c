"""The decode columns ("lanes") are an encoding of the general path's decisions, not a second
policy: one workload driven through a scheduler with lanes and one without gives the same
plans (up to the encoding), the same outputs and the same block tables at every step."""
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pagedserve.pipeline.messages import StepResult
from pagedserve.pipeline.sampling_params import SamplingParams as SP
from pagedserve.pipeline.scheduler import RequestRejected
from pagedserve.pipeline.scheduler.sequence import Request
from sched_fakes import make_scheduler
from test_scheduler_property import BLOCK, EOS, VOCAB, _prompt, config_st, request_st


def canonical_plan(plan) -> dict:
    """A plan with the decode columns spelled out and the per-sequence steps keyed by id."""
    return {
        "new": [(n.seq_id, n.prompt_token_ids, n.output_token_ids, n.block_ids,
                 n.num_computed_tokens, n.table_row, n.sampling) for n in plan.new_seqs],
        "steps": sorted((s.seq_id, s.num_tokens, list(s.new_block_ids), list(s.new_token_ids))
                        for s in plan.seq_steps()),
        "swap_out": plan.swap_out, "swap_in": plan.swap_in, "copy": plan.copy,
        "forks": [(f.parent_id, f.child_ids, f.child_rows) for f in plan.forks],
        "finished": plan.finished_seq_ids,
    }


def canonical_outputs(outputs) -> list:
    return sorted((o.request_id, o.index, tuple(o.new_token_ids), o.finish_reason,
                   o.request_finished, o.logprobs, o.top_logprobs, o.offset) for o in outputs)


def block_tables(sched) -> dict:
    return {sid: sched.kv.block_table(sid) for sid in sched.kv.seq_ids()}


def with_logprobs(result: StepResult) -> StepResult:
    """The same tokens with logprobs attached: the samples take the one-by-one paths."""
    return StepResult(result.step_id, result.seq_ids, result.token_ids,
                      [-t / 100 for t in result.token_ids],
                      [[(t, -t / 100)] for t in result.token_ids])


def run_both(cfg, specs, logprob_every: int, stop_every: int):
    max_model_len = 48
    budget = cfg["max_num_seqs"] + cfg["extra_budget"]
    if not cfg["enable_chunked_prefill"]:
        budget = max(budget, max_model_len)
    pairs = [make_scheduler(
        cfg["num_gpu_blocks"], cfg["num_cpu_blocks"], eos=(EOS,), vocab=VOCAB,
        block_size=BLOCK, max_model_len=max_model_len, max_num_seqs=cfg["max_num_seqs"],
        max_num_batched_tokens=budget, enable_chunked_prefill=cfg["enable_chunked_prefill"],
        enable_prefix_caching=cfg["enable_prefix_caching"], policy=cfg["policy"],
        preemption_mode=cfg["preemption_mode"], swap_threshold_tokens=cfg["swap_threshold_tokens"],
        watermark=cfg["watermark"], max_queued_requests=10, decode_lanes=lanes,
        sliding_window=cfg.get("sliding_window", 0))
        for lanes in (True, False)]
    arrivals, aborts = {}, {}
    for i, spec in enumerate(specs):
        params = SP(max_tokens=spec["max_tokens"], min_tokens=min(spec["min_tokens"],
                                                                  spec["max_tokens"]),
                    ignore_eos=spec["ignore_eos"], n=spec["n"])
        arrivals.setdefault(spec["arrival"], []).append(
            (f"r{i}", _prompt(i, spec), params, float(spec["arrival"] * 100 + i), spec["priority"]))
        if spec["abort_at"] is not None:
            aborts.setdefault(spec["abort_at"], []).append(f"r{i}")
    num_lanes = [0, 0]
    for step_no in range(3000):
        for rid, prompt, params, arrival, priority in arrivals.pop(step_no, []):
            rejected = []
            for sched, _ in pairs:
                try:
                    sched.add(Request(rid, list(prompt), params, arrival, priority))
                except RequestRejected as exc:
                    rejected.append(str(exc))
            assert len(rejected) in (0, 2) and len(set(rejected)) <= 1
        for rid in aborts.pop(step_no, []):
            outs = [canonical_outputs(sched.abort(rid)) for sched, _ in pairs]
            assert outs[0] == outs[1]
        if not pairs[0][0].has_unfinished() and not arrivals:
            assert not pairs[1][0].has_unfinished()
            return num_lanes
        plans = [sched.schedule(float(step_no)) for sched, _ in pairs]
        assert canonical_plan(plans[0]) == canonical_plan(plans[1]), step_no
        assert block_tables(pairs[0][0]) == block_tables(pairs[1][0]), step_no
        for side, plan in enumerate(plans):
            num_lanes[side] += len(plan.decode_seq_ids)
        results = [worker.execute(plan) for (_, worker), plan in zip(pairs, plans)]
        if logprob_every and step_no % logprob_every == logprob_every - 1:
            results = [with_logprobs(r) for r in results]
        if stop_every and step_no % stop_every == stop_every - 1:
            # A stop string found while the step runs (the detokenizer's StopMatched).
            live = sorted(pairs[0][0].requests)
            if live:
                outs = [canonical_outputs(sched.stop(live[0], "stop", 0)) for sched, _ in pairs]
                assert outs[0] == outs[1]
        outs = [canonical_outputs(sched.update(plan, result, float(step_no)))
                for (sched, _), plan, result in zip(pairs, plans, results)]
        assert outs[0] == outs[1], step_no
        assert block_tables(pairs[0][0]) == block_tables(pairs[1][0]), step_no
        assert pairs[0][0].kv.stats() == pairs[1][0].kv.stats(), step_no
    raise AssertionError("not done after 3000 steps")


def _spec(arrival, prompt_len, max_tokens, prefix=0):
    return dict(arrival=arrival, prefix=prefix, prompt_len=prompt_len, max_tokens=max_tokens,
                min_tokens=0, ignore_eos=False, priority=0, n=1, abort_at=None)


# Found by Hypothesis: a lane and a general-path sequence finishing in one step freed their
# blocks in encoding order, and the next admission got other block ids. update() now applies
# stop rules in sequence order whatever the encoding.
_FREE_ORDER_CFG = dict(num_gpu_blocks=8, num_cpu_blocks=0, max_num_seqs=2, extra_budget=0,
                       enable_chunked_prefill=False, enable_prefix_caching=False, policy="fcfs",
                       preemption_mode="swap", swap_threshold_tokens=None, watermark=0.0)
_FREE_ORDER_SPECS = [_spec(14, 13, 4, prefix=1), _spec(0, 1, 1), _spec(0, 1, 1), _spec(0, 1, 1),
                     _spec(13, 1, 4), _spec(14, 1, 1)]


@example(cfg=_FREE_ORDER_CFG, specs=_FREE_ORDER_SPECS, logprob_every=0, stop_every=0)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=config_st, specs=st.lists(request_st, min_size=1, max_size=14),
       logprob_every=st.sampled_from([0, 0, 3, 5]), stop_every=st.sampled_from([0, 0, 4, 9]))
def test_lanes_and_the_general_path_give_the_same_steps(cfg, specs, logprob_every, stop_every):
    lanes_on, lanes_off = run_both(cfg, specs, logprob_every, stop_every)
    assert lanes_off == 0


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=config_st, window=st.sampled_from([1, 4, 6, 9]),
       specs=st.lists(request_st, min_size=1, max_size=14),
       logprob_every=st.sampled_from([0, 0, 3]), stop_every=st.sampled_from([0, 0, 4]))
def test_lanes_and_the_general_path_agree_under_a_sliding_window(cfg, window, specs,
                                                                 logprob_every, stop_every):
    """Blocks sliding out of the window are released at the same point of the order either way
    (a lane ends where its next block slides out)."""
    lanes_on, lanes_off = run_both({**cfg, "sliding_window": window}, specs, logprob_every,
                                   stop_every)
    assert lanes_off == 0


def test_a_steady_windowed_workload_does_use_the_lanes():
    cfg = dict(num_gpu_blocks=16, num_cpu_blocks=8, max_num_seqs=4, extra_budget=8,
               enable_chunked_prefill=True, enable_prefix_caching=True, policy="fcfs",
               preemption_mode="auto", swap_threshold_tokens=None, watermark=0.0,
               sliding_window=6)
    specs = [dict(arrival=i, prefix=i % 2, prompt_len=5 + i, max_tokens=12, min_tokens=0,
                  ignore_eos=True, priority=0, n=1 + (i == 2), abort_at=None) for i in range(5)]
    lanes_on, lanes_off = run_both(cfg, specs, logprob_every=0, stop_every=0)
    assert lanes_on > 20 and lanes_off == 0


def test_a_steady_workload_does_use_the_lanes():
    """The equivalence above is not vacuous: long decodes do travel as columns when lanes are on."""
    cfg = dict(num_gpu_blocks=40, num_cpu_blocks=8, max_num_seqs=4, extra_budget=8,
               enable_chunked_prefill=True, enable_prefix_caching=True, policy="fcfs",
               preemption_mode="auto", swap_threshold_tokens=None, watermark=0.0)
    specs = [dict(arrival=i, prefix=i % 2, prompt_len=5 + i, max_tokens=12, min_tokens=0,
                  ignore_eos=True, priority=0, n=1 + (i == 2), abort_at=None) for i in range(5)]
    lanes_on, lanes_off = run_both(cfg, specs, logprob_every=0, stop_every=0)
    assert lanes_on > 20 and lanes_off == 0
