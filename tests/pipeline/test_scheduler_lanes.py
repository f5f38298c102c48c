"""Steady decodes travel as the plan's decode columns ("lanes") and come back as StepOutputs
columns; everything else about a sequence sends it through `scheduled` again."""
import msgpack
import msgspec
import pytest

from pagedserve.pipeline.messages import StepResult
from pagedserve.pipeline.sampling_params import SamplingParams as SP
from pagedserve.pipeline.scheduler.sequence import Request
from pagedserve.pipeline.scheduler.step_outputs import SequenceOutput, StepOutputs
from sched_fakes import expected_tokens, make_scheduler, step


def lanes(plan):
    return list(zip(plan.decode_seq_ids, plan.decode_token_ids))


def test_a_sequence_decodes_in_the_columns_between_block_boundaries():
    sched, worker = make_scheduler(10, block_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    prompt = [1, 2, 3, 4, 5, 6]
    sched.add(Request("a", prompt, SP(max_tokens=7)))
    want = expected_tokens(prompt, 7, worker.vocab)
    plan, out = step(sched, worker)  # the prompt: a NewSeq and a ScheduledSeq
    assert lanes(plan) == [] and [s.num_tokens for s in plan.scheduled] == [6]
    got = list(out[0].new_token_ids)
    kinds = []
    while sched.has_unfinished():
        plan, out = step(sched, worker)
        if plan.decode_new_blocks:
            kinds.append(("lane", plan.decode_new_blocks))
        else:
            kinds.append("lane" if plan.decode_seq_ids else [s.new_block_ids for s in plan.scheduled])
        if plan.decode_seq_ids:
            assert plan.scheduled == [] and lanes(plan) == [(0, got[-1])]
        got += out[0].new_token_ids
    # slots 6, 7 lie in block 1; slot 8 opens block 2 (still a lane, the block in
    # decode_new_blocks); slots 9 and 10 are lanes; slot 11 samples the 7th token, which ends
    # the request by length, so it is not a lane (update checks the length outside the columns)
    assert kinds == ["lane", "lane", ("lane", [(0, 2)]), "lane", "lane", [[]]]
    assert got == want and out[0].finish_reason == "length"
    assert sched.kv.stats().gpu_blocks_used == 0


def test_decode_columns_survive_the_wire():
    sched, worker = make_scheduler(10, block_size=4)
    sched.add(Request("a", [1, 2, 3], SP(max_tokens=4)))
    step(sched, worker)
    plan = sched.schedule(1.0)
    raw = msgpack.unpackb(msgspec.msgpack.encode(plan))
    assert raw["decode_seq_ids"] == [0] and raw["decode_token_ids"] == plan.decode_token_ids
    assert raw["decode_new_blocks"] == []
    assert plan.num_scheduled == 1 and plan.num_tokens == 1
    assert [(s.seq_id, s.num_tokens, s.new_block_ids) for s in plan.seq_steps()] == [(0, 1, [])]
    sched.update(plan, worker.execute(plan), 1.0)
    plan = sched.schedule(2.0)  # slot 4 opens the second block
    raw = msgpack.unpackb(msgspec.msgpack.encode(plan))
    assert raw["decode_seq_ids"] == [0] and raw["decode_new_blocks"] == [[0, 1]]


def test_a_stop_id_sampled_in_a_lane_finishes_it():
    sched, worker = make_scheduler(10, block_size=4, eos=(999,))
    sched.add(Request("a", [1, 2, 3], SP(max_tokens=10)))
    sched.add(Request("b", [4, 5, 6], SP(max_tokens=10)))
    step(sched, worker)
    worker.script[0] = [999]  # a samples EOS in its first lane step
    plan, out = step(sched, worker)
    assert plan.decode_seq_ids == [0, 1]
    assert isinstance(out, StepOutputs) and len(out.seqs) == 1 and len(out.others) == 1
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in out] == \
        [("b", out.token_ids, None), ("a", [999], "stop")]
    assert sched.schedule(2.0).finished_seq_ids == [0]


def test_min_tokens_keeps_a_lane_going_past_a_stop_id():
    sched, worker = make_scheduler(10, block_size=4, eos=(999,))
    sched.add(Request("a", [1, 2, 3], SP(max_tokens=10, min_tokens=3)))
    step(sched, worker)
    worker.script[0] = [999, 999]
    plan, out = step(sched, worker)  # the 2nd output: below min_tokens, so EOS does not stop
    assert plan.decode_seq_ids == [0] and out[0].finish_reason is None
    plan, out = step(sched, worker)  # the 3rd stops
    assert out[0].finish_reason == "stop" and not sched.has_unfinished()


def test_abort_while_a_lane_is_in_flight():
    sched, worker = make_scheduler(10, block_size=4)
    sched.add(Request("a", [1, 2, 3], SP(max_tokens=10)))
    sched.add(Request("b", [4, 5, 6], SP(max_tokens=10)))
    step(sched, worker)
    plan = sched.schedule(1.0)
    assert plan.decode_seq_ids == [0, 1]
    assert [o.finish_reason for o in sched.abort("a")] == ["abort"]
    out = sched.update(plan, worker.execute(plan), 1.0)
    assert [o.request_id for o in out] == ["b"]
    plan, _ = step(sched, worker, 2.0)  # b crosses into its second block
    assert plan.finished_seq_ids == [0] and plan.decode_seq_ids == [1]
    assert plan.decode_new_blocks == [(0, plan.seq_steps()[0].new_block_ids[0])]


def test_rows_out_of_order_and_logprobs_take_the_general_path():
    sched, worker = make_scheduler(10, block_size=4)
    sched.add(Request("a", [1, 2], SP(max_tokens=10)))
    sched.add(Request("b", [4, 5], SP(max_tokens=10)))
    step(sched, worker)
    plan = sched.schedule(1.0)
    assert plan.decode_seq_ids == [0, 1]
    out = sched.update(plan, StepResult(plan.step_id, [1, 0], [11, 10], None, None), 1.0)
    assert [(o.request_id, o.new_token_ids) for o in out] == [("a", [10]), ("b", [11])]
    plan = sched.schedule(2.0)
    assert plan.decode_token_ids == [10, 11]
    out = sched.update(plan, StepResult(plan.step_id, [0, 1], [12, 13], [-0.5, -1.5],
                                        [[(12, -0.5)], [(13, -1.5)]]), 2.0)
    assert [(o.request_id, o.logprobs, o.top_logprobs) for o in out] == \
        [("a", [-0.5], [[(12, -0.5)]]), ("b", [-1.5], [[(13, -1.5)]])]


def test_a_result_missing_a_lane_row_is_an_error():
    sched, worker = make_scheduler(10, block_size=4)
    sched.add(Request("a", [1, 2, 3], SP(max_tokens=10)))
    step(sched, worker)
    plan = sched.schedule(1.0)
    with pytest.raises(ValueError, match="has no token for sequence 0"):
        sched.update(plan, StepResult(plan.step_id, [], [], None, None), 1.0)


def test_step_outputs_read_like_a_list_of_sequence_outputs():
    sched, worker = make_scheduler(10, block_size=4)
    sched.add(Request("a", [1, 2, 3], SP(max_tokens=10)))
    step(sched, worker)
    seq = sched.queues.running[0]
    extra = SequenceOutput("z", 0, [5], "stop", True)
    out = StepOutputs([seq], [7], [extra])
    assert len(out) == 2
    assert out[0] == SequenceOutput("a", 0, [7]) and out[-1] is extra and out[1] is extra
    assert out[:1] == [SequenceOutput("a", 0, [7])]
    assert out == [SequenceOutput("a", 0, [7]), extra]
    with pytest.raises(IndexError):
        out[2]
    assert StepOutputs([], [], []) == []
