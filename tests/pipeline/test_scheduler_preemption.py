"""Priority preemption by swap and by recompute: the victim resumes and finishes with the same
tokens it would have produced undisturbed (the fake model's next token is a function of the
whole history, read back out of the fake KV cache)."""
import pytest

from pagedserve.pipeline.sampling_params import SamplingParams as SP
from pagedserve.pipeline.scheduler.preemption import PreemptionCostModel, swap_or_recompute
from pagedserve.pipeline.scheduler.sequence import Request
from sched_fakes import drive, expected_tokens, make_scheduler, step

LOW_PROMPT = list(range(1, 13))  # 3 blocks of 4
HIGH_PROMPT = list(range(40, 52))


def _busy_low_priority(policy, mode):
    sched, worker = make_scheduler(6, 8, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                                   policy=policy, preemption_mode=mode)
    sched.add(Request("low", LOW_PROMPT, SP(max_tokens=8), arrival_time=0, priority=5))
    for _ in range(2):
        step(sched, worker)  # low holds 4 blocks (13 slots), 2 are free
    sched.add(Request("high", HIGH_PROMPT, SP(max_tokens=4), arrival_time=1, priority=0))
    return sched, worker


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_high_priority_arrival_preempts_and_victim_resumes(mode):
    sched, worker = _busy_low_priority("priority", mode)
    plan, out = step(sched, worker)
    assert [n.seq_id for n in plan.new_seqs] == [1]  # high is admitted at once ...
    assert [s.seq_id for s in plan.seq_steps()] == [1]  # ... and low does not run
    assert sched.num_preemptions == 1
    if mode == "swap":
        assert [gpu for gpu, _ in plan.swap_out] == [0, 1, 2, 3] and sched.num_swapped == 1
    else:
        assert plan.swap_out == [] and sched.num_waiting == 1
    tokens, reasons, plans = drive(sched, worker)
    assert tokens["low"][0][-6:] == expected_tokens(LOW_PROMPT, 8, worker.vocab)[2:]
    assert tokens["high"][0] == expected_tokens(HIGH_PROMPT, 4, worker.vocab)[1:]
    assert reasons == {"low": {0: "length"}, "high": {0: "length"}}
    # high finished before low came back
    first_low = next(i for i, p in enumerate(plans) if any(s.seq_id == 0 for s in p.scheduled))
    last_high = max(i for i, p in enumerate(plans) if any(s.seq_id == 1 for s in p.scheduled))
    assert first_low > last_high
    resent = plans[first_low].new_seqs[0]
    assert resent.seq_id == 0 and resent.output_token_ids == \
        expected_tokens(LOW_PROMPT, 8, worker.vocab)[:2]
    assert sched.kv.stats().gpu_blocks_used == sched.kv.stats().cpu_blocks_used == 0


def test_fcfs_never_preempts_for_a_newcomer():
    sched, worker = _busy_low_priority("fcfs", "swap")
    tokens, reasons, plans = drive(sched, worker)
    assert sched.num_preemptions == 0
    assert tokens["low"][0] == expected_tokens(LOW_PROMPT, 8, worker.vocab)[2:]
    first_high = next(i for i, p in enumerate(plans) if p.new_seqs)
    assert plans[first_high].finished_seq_ids == [0]  # it waited for low to finish


def test_equal_priority_does_not_preempt():
    sched, worker = make_scheduler(6, 8, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                                   policy="priority", preemption_mode="swap")
    sched.add(Request("a", LOW_PROMPT, SP(max_tokens=8), arrival_time=0, priority=1))
    step(sched, worker)
    step(sched, worker)
    sched.add(Request("b", HIGH_PROMPT, SP(max_tokens=4), arrival_time=1, priority=1))
    plan, _ = step(sched, worker)
    assert [s.seq_id for s in plan.seq_steps()] == [0] and plan.swap_out == []


def test_victims_lowest_priority_then_latest_arrival():
    # Three decoders compete for a pool that cannot hold them all; the victim must be the
    # latest-arriving of the lowest priority.
    sched, worker = make_scheduler(7, 0, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                                   policy="priority", preemption_mode="recompute")
    sched.add(Request("a", [1, 2, 3, 4], SP(max_tokens=8), arrival_time=0, priority=1))
    sched.add(Request("b", [5, 6, 7, 8], SP(max_tokens=8), arrival_time=1, priority=2))
    sched.add(Request("c", [9, 10, 11, 12], SP(max_tokens=8), arrival_time=2, priority=2))
    victims = []
    while sched.num_preemptions == 0:
        plan, _ = step(sched, worker)
        victims = [s for s in sched.seqs.values() if s.status.name == "WAITING"]
    assert [v.request_id for v in victims] == ["c"]
    tokens, _, _ = drive(sched, worker)
    assert sched.kv.stats().gpu_blocks_used == 0


def test_auto_mode_recomputes_short_and_swaps_long():
    assert swap_or_recompute("auto", 99, can_swap=True, swap_threshold_tokens=100) == "recompute"
    assert swap_or_recompute("auto", 100, can_swap=True, swap_threshold_tokens=100) == "swap"
    assert swap_or_recompute("auto", 5000, can_swap=False) == "recompute"  # host pool full
    assert swap_or_recompute("swap", 1, can_swap=True) == "swap"
    assert swap_or_recompute("recompute", 10**6, can_swap=True) == "recompute"


def test_cost_model_threshold_is_the_break_even_length():
    model = PreemptionCostModel()
    t = model.swap_threshold_tokens()
    assert model.swap_cost(t) <= model.recompute_cost(t)
    assert model.swap_cost(t - 1) > model.recompute_cost(t - 1)
    assert 50 < t < 1000
    # a faster host link makes swapping pay off sooner
    assert PreemptionCostModel(host_bytes_per_s=100e9).swap_threshold_tokens() < t
