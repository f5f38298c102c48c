"""Admission control, configuration checks, stop rules, abort/stop and resubmission."""
import pytest

from pagedserve.pipeline.messages import StepResult
from pagedserve.pipeline.sampling_params import SamplingParams as SP
from pagedserve.pipeline.scheduler import QueueFull, RequestRejected, SchedulerConfig
from pagedserve.pipeline.scheduler.sequence import Request
from sched_fakes import drive, expected_tokens, make_scheduler, step

EOS = 2


def _sched(**kw):
    kw.setdefault("block_size", 4)
    kw.setdefault("max_num_seqs", 4)
    kw.setdefault("max_num_batched_tokens", 16)
    return make_scheduler(kw.pop("gpu", 16), kw.pop("cpu", 0), eos=(EOS,), **kw)


def test_too_long_for_max_model_len_names_the_numbers():
    sched, _ = _sched(max_model_len=64)
    with pytest.raises(RequestRejected) as e:
        sched.add(Request("r", [5] * 50, SP(max_tokens=20)))
    assert "prompt has 50 tokens and max_tokens is 20, together 70, but max_model_len is 64" \
        in str(e.value)
    with pytest.raises(RequestRejected, match="prompt has 64 tokens but max_model_len is 64"):
        sched.add(Request("r", [5] * 64, SP(max_tokens=None)))


def test_never_fits_in_the_pool_names_the_numbers():
    sched, _ = _sched(gpu=20, max_model_len=1024, watermark=0.1)
    with pytest.raises(RequestRejected) as e:
        sched.add(Request("r", [5] * 70, SP(max_tokens=6)))
    assert "needs 19 blocks of 4 tokens but the KV cache has only 18 usable blocks " \
           "(20 minus 2 kept free by the watermark)" in str(e.value)
    sched.add(Request("ok", [5] * 66, SP(max_tokens=6)))  # 18 blocks: fits


def test_full_queue_is_its_own_rejection():
    sched, _ = _sched(max_queued_requests=2)
    sched.add(Request("a", [5, 6], SP()))
    sched.add(Request("b", [5, 6], SP()))
    with pytest.raises(QueueFull, match="2 requests queued, max_queued_requests is 2") as e:
        sched.add(Request("c", [5, 6], SP()))
    assert isinstance(e.value, RequestRejected) and e.value.request_id == "c"
    sched.abort("a")  # a queued abort frees its place
    sched.add(Request("c", [5, 6], SP()))


def test_admitted_requests_leave_the_queue():
    sched, worker = _sched(max_queued_requests=1)
    sched.add(Request("a", [5, 6], SP(max_tokens=5)))
    step(sched, worker)
    sched.add(Request("b", [5, 6], SP()))  # a is running, no longer queued


@pytest.mark.parametrize("request_, field", [
    (Request("r", [], SP()), "prompt has no tokens"),
    (Request("r", [1, -3], SP()), r"prompt_token_ids\[1\] is -3, not a token id"),
    (Request("r", [1, 2], SP(temperature=5.0)), "temperature"),
    (Request("r", [1, 2], SP(n=2), output_token_ids=[3]), "n=1"),
    (Request("r", [1, 2], SP(n=5)), "max_num_seqs is 4"),
    (Request("r", [1, 2], SP(max_tokens=2), output_token_ids=[3, 4]), "nothing left"),
])
def test_bad_requests_are_rejected_with_the_cause(request_, field):
    sched, _ = _sched()
    with pytest.raises(RequestRejected, match=field):
        sched.add(request_)
    assert not sched.has_unfinished()


def test_duplicate_request_id():
    sched, _ = _sched()
    sched.add(Request("r", [1, 2], SP()))
    with pytest.raises(RequestRejected, match="already in flight"):
        sched.add(Request("r", [1, 2], SP()))


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_model_len=0), "max_model_len must be a positive integer"),
    (dict(max_model_len=64, preemption_mode="drop"), "preemption_mode must be one of"),
    (dict(max_model_len=64, policy="lifo"), "policy must be one of"),
    (dict(max_model_len=64, watermark=1.5), "watermark must be in"),
    (dict(max_model_len=64, max_num_seqs=300, max_num_batched_tokens=256),
     r"max_num_batched_tokens \(256\) must be at least max_num_seqs \(300\)"),
    (dict(max_model_len=4096, enable_chunked_prefill=False),
     r"without chunked prefill max_num_batched_tokens \(2048\) must be at least max_model_len"),
])
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**kwargs)


def test_block_size_mismatch_is_refused():
    from pagedserve.kvmanager import KVCacheManager
    from pagedserve.pipeline.scheduler import Scheduler
    with pytest.raises(ValueError, match="block_size mismatch"):
        Scheduler(SchedulerConfig(max_model_len=64, block_size=16), KVCacheManager(8, 8))


def _run_scripted(sampling, script, prompt=(1, 2, 3)):
    sched, worker = _sched()
    sched.add(Request("r", list(prompt), sampling))
    worker.script[0] = list(script)
    tokens, reasons, _ = drive(sched, worker)
    return tokens["r"][0], reasons["r"][0]


def test_eos_stops_unless_ignored():
    assert _run_scripted(SP(max_tokens=6), [10, EOS, 11]) == ([10, EOS], "stop")
    assert _run_scripted(SP(max_tokens=4, ignore_eos=True), [10, EOS, 11, 12]) == \
        ([10, EOS, 11, 12], "length")


def test_stop_token_ids_and_min_tokens():
    assert _run_scripted(SP(max_tokens=6, stop_token_ids=[11]), [10, 11, 12]) == ([10, 11], "stop")
    # min_tokens: a stop id before the 3rd output token does not stop
    assert _run_scripted(SP(max_tokens=6, min_tokens=3), [EOS, 10, EOS, 11]) == \
        ([EOS, 10, EOS], "stop")
    assert _run_scripted(SP(max_tokens=6, min_tokens=3, ignore_eos=True,
                            stop_token_ids=[11]), [11, EOS, 12, 11]) == ([11, EOS, 12, 11], "stop")


def test_abort_waiting_and_running():
    sched, worker = _sched(max_num_seqs=1)
    sched.add(Request("a", [1, 2, 3], SP(max_tokens=10), arrival_time=0))
    sched.add(Request("b", [4, 5, 6], SP(max_tokens=10), arrival_time=1))
    step(sched, worker)
    assert [(o.request_id, o.finish_reason, o.request_finished) for o in sched.abort("b")] == \
        [("b", "abort", True)]
    assert sched.abort("b") == [] and sched.abort("nope") == []
    out = sched.abort("a")
    assert [(o.request_id, o.index, o.new_token_ids, o.finish_reason) for o in out] == \
        [("a", 0, [], "abort")]
    assert sched.kv.stats().gpu_blocks_used == 0 and not sched.has_unfinished()
    plan = sched.schedule(1.0)
    assert plan.finished_seq_ids == [0] and plan.seq_steps() == []  # b never reached the workers
    stats = sched.stats()
    assert (stats.num_running, stats.num_waiting) == (0, 0)


def test_abort_while_the_step_runs_discards_its_token():
    sched, worker = _sched()
    sched.add(Request("a", [1, 2, 3], SP(max_tokens=10)))
    plan = sched.schedule(0.0)
    result = worker.execute(plan)
    sched.abort("a")
    assert sched.update(plan, result, 0.0) == []
    assert sched.kv.stats().gpu_blocks_used == 0


def test_stop_from_the_detokenizer_and_n_samples():
    sched, worker = _sched(salt_of=lambda sid: sid)
    sched.add(Request("a", [1, 2, 3], SP(max_tokens=10, n=3)))
    step(sched, worker)
    out = sched.stop("a", "stop", index=1)
    assert [(o.index, o.finish_reason, o.request_finished) for o in out] == [(1, "stop", False)]
    plan, out = step(sched, worker)
    assert plan.finished_seq_ids == [1] and {o.index for o in out} == {0, 2}
    out = sched.stop("a")
    assert [(o.index, o.request_finished) for o in out] == [(0, False), (2, True)]
    assert not sched.has_unfinished() and sched.kv.stats().gpu_blocks_used == 0
    with pytest.raises(ValueError, match="finish reason must be one of"):
        sched.stop("x", "because")


def test_resubmitted_request_recomputes_its_outputs_and_counts_them():
    prompt = [7, 8, 9, 10, 11]
    want = expected_tokens(prompt, 6, 1000)
    sched, worker = _sched()
    sched.add(Request("r", prompt, SP(max_tokens=6), output_token_ids=want[:4]))
    plan, out = step(sched, worker)
    assert plan.new_seqs[0].output_token_ids == want[:4]
    assert plan.seq_steps()[0].num_tokens == 9  # prompt and the 4 earlier outputs
    assert out[0].new_token_ids == want[4:5]
    tokens, reasons, _ = drive(sched, worker)
    assert tokens["r"][0] == want[5:] and reasons["r"][0] == "length"


def test_update_checks_the_result():
    sched, worker = _sched()
    sched.add(Request("a", [1, 2, 3], SP()))
    plan = sched.schedule(0.0)
    with pytest.raises(RuntimeError, match="schedule\\(\\) called again"):
        sched.schedule(0.0)
    with pytest.raises(ValueError, match="StepResult is for step 7"):
        sched.update(plan, StepResult(7, [0], [1], None, None), 0.0)
    with pytest.raises(ValueError, match="no token for sequence 0"):
        sched.update(plan, StepResult(plan.step_id, [], [], None, None), 0.0)


def test_logprobs_pass_through():
    sched, worker = _sched()
    sched.add(Request("a", [1, 2, 3], SP(max_tokens=2, logprobs=1)))
    plan = sched.schedule(0.0)
    out = sched.update(plan, StepResult(plan.step_id, [0], [9], [-0.5], [[(9, -0.5), (4, -1.0)]]),
                       0.0)
    assert (out[0].logprobs, out[0].top_logprobs) == ([-0.5], [[(9, -0.5), (4, -1.0)]])


def test_token_ids_are_checked_against_the_vocabulary_at_the_gate():
    """The one gate every entry point passes: an id the model does not have never reaches a
    worker (its embedding would raise, on every restart of the group)."""
    sched, _ = make_scheduler(20, block_size=4, vocab_size=100, max_num_seqs=4)
    bad = {
        r"prompt_token_ids\[2\] is 100, outside the vocabulary \[0, 100\)":
            Request("a", [1, 2, 100], SP()),
        r"output_token_ids\[0\] is 250, outside the vocabulary":
            Request("b", [1, 2], SP(), output_token_ids=[250]),
        r"stop_token_ids contains 100, outside the vocabulary":
            Request("c", [1, 2], SP(stop_token_ids=[100])),
        r"logit_bias contains 123, outside the vocabulary":
            Request("d", [1, 2], SP(logit_bias={123: 1.0})),
        r"prompt_token_ids\[0\] is True, not a token id": Request("e", [True], SP()),
    }
    for message, request in bad.items():
        with pytest.raises(RequestRejected, match=message):
            sched.add(request)
    assert not sched.has_unfinished()
    sched.add(Request("ok", [0, 99], SP(stop_token_ids=[99], logit_bias={5: -1.0})))
