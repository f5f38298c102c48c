"""Exact plans: a tiny pool (blocks of 4 tokens), which sequences run, how many tokens each
computes and which blocks are allocated, copied, swapped and freed, step by step."""
import msgpack
import msgspec

from pagedserve.pipeline.messages import StepPlan, StepResult
from pagedserve.pipeline.sampling_params import SamplingParams as SP
from pagedserve.pipeline.scheduler.sequence import Request
from sched_fakes import brief, expected_tokens, make_scheduler, plan_shape, step


def test_one_request_step_by_step():
    sched, worker = make_scheduler(10, block_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    prompt = [1, 2, 3, 4, 5, 6]
    sched.add(Request("a", prompt, SP(max_tokens=4)))
    want = expected_tokens(prompt, 4, worker.vocab)

    plan, out = step(sched, worker)
    assert brief(plan) == plan_shape(new=[(0, [0, 1], 0, 0)], run=[(0, 6, [])])
    assert plan.new_seqs[0].prompt_token_ids == prompt
    assert [(o.request_id, o.index, o.new_token_ids, o.finish_reason) for o in out] == \
        [("a", 0, want[:1], None)]
    plan, _ = step(sched, worker)  # slot 6: still block 1
    assert brief(plan) == plan_shape(run=[(0, 1, [])])
    assert plan.seq_steps()[0].new_token_ids == want[:1]  # the diff: only the sampled token
    plan, _ = step(sched, worker)  # slot 7 fills block 1
    assert brief(plan) == plan_shape(run=[(0, 1, [])])
    plan, out = step(sched, worker)  # slot 8 opens block 2
    assert brief(plan) == plan_shape(run=[(0, 1, [2])])
    assert (out[0].new_token_ids, out[0].finish_reason, out[0].request_finished) == \
        (want[3:], "length", True)
    assert not sched.has_unfinished()
    assert sched.kv.stats().gpu_blocks_used == 0
    plan = sched.schedule(1.0)  # the workers learn that seq 0 is gone
    assert brief(plan) == plan_shape(finished=[0])


def test_chunked_prefill_fills_the_budget():
    sched, worker = make_scheduler(20, block_size=4, max_num_seqs=8, max_num_batched_tokens=8)
    sched.add(Request("a", list(range(1, 11)), SP(max_tokens=5), arrival_time=0))
    sched.add(Request("b", list(range(20, 25)), SP(max_tokens=5), arrival_time=1))
    plan, out = step(sched, worker)  # a's first 8 tokens take the whole budget
    assert brief(plan) == plan_shape(new=[(0, [0, 1], 0, 0)], run=[(0, 8, [])])
    assert out == []  # a mid-prompt chunk samples nothing
    plan, out = step(sched, worker)  # a's last 2 tokens, then b's whole prompt
    assert brief(plan) == plan_shape(new=[(1, [3, 4], 0, 0)], run=[(0, 2, [2]), (1, 5, [])])
    assert [o.request_id for o in out] == ["a", "b"]
    plan, _ = step(sched, worker)  # both decode
    assert brief(plan) == plan_shape(run=[(0, 1, []), (1, 1, [])])


def test_chunked_prefill_off_admits_whole_prompts_only():
    sched, worker = make_scheduler(20, block_size=4, max_num_seqs=4, max_num_batched_tokens=12,
                                   max_model_len=12, enable_chunked_prefill=False)
    sched.add(Request("a", list(range(1, 8)), SP(max_tokens=2), arrival_time=0))
    sched.add(Request("b", list(range(20, 27)), SP(max_tokens=2), arrival_time=1))
    plan, _ = step(sched, worker)  # b's 7 tokens do not fit in the 5 left: it waits whole
    assert brief(plan)["run"] == [(0, 7, [])]
    plan, _ = step(sched, worker)
    assert brief(plan)["run"] == [(0, 1, []), (1, 7, [])]


def test_prefix_cache_hit_skips_cached_tokens():
    sched, worker = make_scheduler(10, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    sched.add(Request("a", list(range(1, 10)), SP(max_tokens=1)))
    plan, out = step(sched, worker)
    assert brief(plan) == plan_shape(new=[(0, [0, 1, 2], 0, 0)], run=[(0, 9, [])])
    assert out[0].finish_reason == "length"
    prompt_b = list(range(1, 9)) + [50, 51]
    sched.add(Request("b", prompt_b, SP(max_tokens=2)))
    plan, out = step(sched, worker)
    # blocks 0 and 1 hold a's first 8 tokens; a's partial block 2 (never cached: reused first)
    # takes the rest. Only 2 tokens are computed.
    assert brief(plan) == plan_shape(new=[(1, [0, 1, 2], 8, 0)], run=[(1, 2, [])], finished=[0])
    assert out[0].new_token_ids == expected_tokens(prompt_b, 1, worker.vocab)
    stats = sched.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (9 + 10, 8)


def test_fork_shares_blocks_and_copies_on_write():
    sched, worker = make_scheduler(10, block_size=4, max_num_seqs=4, max_num_batched_tokens=8,
                                   salt_of=lambda seq_id: seq_id)
    prompt = [1, 2, 3, 4, 5, 6]
    sched.add(Request("a", prompt, SP(max_tokens=3, n=2)))
    plan, out = step(sched, worker)
    assert brief(plan) == plan_shape(new=[(0, [0, 1], 0, 0)], run=[(0, 6, [])], forks=[(0, [1])])
    assert [(o.index, o.new_token_ids) for o in out] == [
        (0, expected_tokens(prompt, 1, worker.vocab, salt=0)),
        (1, expected_tokens(prompt, 1, worker.vocab, salt=1))]
    assert sched.kv.stats().gpu_blocks_used == 2  # shared, not copied
    plan, _ = step(sched, worker)
    # The parent writes slot 6 into shared block 1 first: it gets a copy (block 2) and is
    # resent whole; the child is then block 1's only holder and writes in place.
    assert brief(plan) == plan_shape(new=[(0, [0, 2], 6, 1)], run=[(0, 1, []), (1, 1, [])],
                                     copy=[(1, 2)])
    plan, out = step(sched, worker)
    assert brief(plan) == plan_shape(run=[(0, 1, []), (1, 1, [])])
    assert [(o.index, o.finish_reason, o.request_finished) for o in out] == \
        [(0, "length", False), (1, "length", True)]
    assert sched.requests == {}
    assert sched.kv.stats().gpu_blocks_used == 0


def _two_requests(mode):
    sched, worker = make_scheduler(4, 4, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                                   preemption_mode=mode)
    sched.add(Request("a", list(range(1, 9)), SP(max_tokens=6), arrival_time=0))
    sched.add(Request("b", list(range(11, 15)), SP(max_tokens=4), arrival_time=1))
    return sched, worker


def test_preempt_by_swap_exact():
    sched, worker = _two_requests("swap")
    plan, _ = step(sched, worker)
    assert brief(plan) == plan_shape(new=[(0, [0, 1], 0, 0), (1, [2], 0, 0)],
                                     run=[(0, 8, []), (1, 4, [])])
    plan, _ = step(sched, worker)
    # a takes the last free block; b, the later arrival, cannot grow and goes to host block 0
    assert brief(plan) == plan_shape(run=[(0, 1, [3])], swap_out=[(2, 0)])
    assert (sched.num_swapped, sched.num_preemptions) == (1, 1)
    for _ in range(4):
        plan, out = step(sched, worker)
        assert [s.seq_id for s in plan.seq_steps()] == [0] and plan.swap_in == []
    assert out[0].finish_reason == "length"
    plan, _ = step(sched, worker)
    # b comes back into a's freed blocks and is resent whole with its new block table
    assert brief(plan) == plan_shape(new=[(1, [2, 3], 4, 1)], run=[(1, 1, [])],
                                     swap_in=[(0, 2)], finished=[0])
    tokens, reasons, _ = _finish(sched, worker)
    assert sched.kv.stats().cpu_blocks_used == 0


def test_preempt_by_recompute_exact():
    sched, worker = _two_requests("recompute")
    step(sched, worker)
    plan, _ = step(sched, worker)
    assert brief(plan) == plan_shape(run=[(0, 1, [3])])  # b's blocks are simply freed
    assert (sched.num_waiting, sched.num_preemptions) == (1, 1)
    for _ in range(4):
        plan, out = step(sched, worker)
    assert out[0].finish_reason == "length"
    plan, _ = step(sched, worker)
    # b's prompt and its one output token are computed again; it samples only at the end
    assert brief(plan) == plan_shape(new=[(1, [2, 3], 0, 1)], run=[(1, 5, [])], finished=[0])


def _finish(sched, worker):
    from sched_fakes import drive
    return drive(sched, worker)


def test_preempted_sequences_finish_with_the_reference_tokens():
    for mode in ("swap", "recompute", "auto"):
        sched, worker = _two_requests(mode)
        tokens, reasons, _ = _finish(sched, worker)
        assert tokens["a"][0] == expected_tokens(list(range(1, 9)), 6, worker.vocab)
        assert tokens["b"][0] == expected_tokens(list(range(11, 15)), 4, worker.vocab)
        assert reasons == {"a": {0: "length"}, "b": {0: "length"}}
        assert sched.kv.stats().gpu_blocks_used == 0


def test_plan_round_trips_through_msgpack():
    sched, worker = make_scheduler(10, block_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    sched.add(Request("a", [1, 2, 3, 4, 5, 6], SP(max_tokens=3, n=2, temperature=0.5)))
    plan = sched.schedule(0.0)
    wire = msgspec.msgpack.encode(plan)
    assert msgspec.msgpack.decode(wire, type=StepPlan) == plan
    plain = msgpack.unpackb(wire)
    assert plain["step_id"] == 0 and plain["shared_tables"] is None
    assert plain["forks"] == [{"parent_id": 0, "child_ids": [1], "child_rows": []}]
    new = plain["new_seqs"][0]
    assert new["prompt_token_ids"] == [1, 2, 3, 4, 5, 6] and new["block_ids"] == [0, 1]
    assert new["sampling"]["n"] == 2 and new["sampling"]["temperature"] == 0.5
    assert plain["scheduled"] == [{"seq_id": 0, "num_tokens": 6, "new_block_ids": [],
                                   "new_token_ids": []}]
    result = worker.execute(plan)
    wire = msgspec.msgpack.encode(result)
    assert msgspec.msgpack.decode(wire, type=StepResult) == result
    assert msgpack.unpackb(wire)["seq_ids"] == [0, 1]
    sched.update(plan, msgspec.msgpack.decode(wire, type=StepResult), 0.0)
