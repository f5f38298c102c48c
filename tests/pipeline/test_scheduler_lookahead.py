"""Overlapped scheduling (Scheduler.schedule_ahead): a step of steady decodes planned
before the result of the one in flight is back, its tokens taken by the worker from its own
samples. Driven through the scheduler process's own StepLoop, against the fake worker that checks
every slot it reads: the same tokens and finish reasons as without it, whatever finishes,
aborts or stops while two steps are in flight, and nothing ahead of a queued request."""
from collections import deque

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.pipeline.sampling_params import SamplingParams as SP
from pagedserve.pipeline.scheduler import RequestRejected
from pagedserve.pipeline.scheduler.sequence import Request
from pagedserve.pipeline.scheduler.step_loop import StepLoop
from sched_fakes import expected_tokens, make_scheduler
from test_scheduler_property import BLOCK, EOS, VOCAB, _prompt, config_st, request_st


class AheadWorker:
    """The fake worker, taking an ahead plan's tokens from what it sampled last (as
    workers/core.py does)."""

    def __init__(self, worker):
        self.worker = worker
        self.last: dict[int, int] = {}
        self.ahead_steps = 0
        self.blocks_opened_ahead = 0

    def execute(self, plan):
        if plan.ahead:
            self.ahead_steps += 1
            self.blocks_opened_ahead += len(plan.decode_new_blocks)
            assert set(plan.decode_token_ids) == {-1}
            assert not (plan.new_seqs or plan.scheduled or plan.swap_out or plan.swap_in
                        or plan.copy or plan.forks)
            plan = msgspec.structs.replace(plan, ahead=False, decode_token_ids=[
                self.last[sid] for sid in plan.decode_seq_ids])
        result = self.worker.execute(plan)
        self.last.update(zip(result.seq_ids, result.token_ids))
        return result


class Recorder:
    """Stands in for SchedulerService: applies each result and keeps what each sample gained."""

    def __init__(self, sched, clock):
        self.scheduler, self.clock = sched, clock
        self.tokens, self.reasons = {}, {}

    def on_step_result(self, plan, result):
        for out in self.scheduler.update(plan, result, self.clock()):
            self.tokens.setdefault(out.request_id, {}).setdefault(out.index, []).extend(
                out.new_token_ids)
            if out.finish_reason is not None:
                self.reasons.setdefault(out.request_id, {})[out.index] = out.finish_reason


def drive_overlapped(sched, worker, arrivals, aborts=None, stops=None, overlap=True,
                     max_steps=3000):
    """The real StepLoop (pipeline/scheduler/step_loop.py) as the scheduler process runs it,
    the plans it sends run in order by `worker`. Aborts and stop strings land while steps are
    in flight."""
    tick = 0
    service = Recorder(sched, lambda: float(tick))
    sent = deque()
    loop = StepLoop(service, lambda plan: sent.append(plan) or True, overlap=overlap,
                    clock=lambda: float(tick))
    reasons, cut = service.reasons, set()  # cut: aborted or stopped by the driver
    aborts, stops = dict(aborts or {}), dict(stops or {})
    for tick in range(max_steps):
        for req in arrivals.pop(tick, []):
            try:
                sched.add(req)
            except RequestRejected:
                pass
        if loop.ready():
            loop.start(float(tick))
        elif not sent and not arrivals and not sched.has_unfinished():
            return service.tokens, reasons, cut
        for rid in aborts.pop(tick, []):
            cut.add(rid)
            for out in sched.abort(rid):
                reasons.setdefault(out.request_id, {})[out.index] = out.finish_reason
        if tick in stops and sched.requests:  # a stop string the detokenizer found
            cut.add(min(sched.requests))
            for out in sched.stop(min(sched.requests), "stop", 0):
                reasons.setdefault(out.request_id, {})[out.index] = out.finish_reason
        if sent:
            assert loop.on_result(worker.execute(sent.popleft())) is not None
    raise AssertionError("not done")


def single_stream(max_tokens=40, stop_ids=(EOS,), **cfg):
    sched, worker = make_scheduler(64, eos=stop_ids, vocab=VOCAB, block_size=BLOCK, **cfg)
    prompt = [9, 10, 11, 12, 13]
    req = Request("r", prompt, SP(max_tokens=max_tokens, ignore_eos=not stop_ids), 0.0)
    return sched, AheadWorker(worker), req, expected_tokens(prompt, max_tokens, VOCAB, 0,
                                                            stop_ids)


def test_one_stream_runs_ahead_and_gives_the_same_tokens():
    sched, worker, req, want = single_stream(max_tokens=40, stop_ids=())
    tokens, reasons, _ = drive_overlapped(sched, worker, {0: [req]})
    assert tokens["r"][0] == want and reasons["r"][0] == "length"
    # every decode step but the first (planned from the prefill's result) and the last (whose
    # token ends it by length), those that open one of its blocks included
    assert worker.ahead_steps == 40 - 1 - 2, worker.ahead_steps
    assert worker.blocks_opened_ahead == 9
    assert not sched.kv.seq_ids()


def test_a_stream_ending_on_a_stop_id_drops_the_token_computed_ahead():
    sched, worker, req, want = single_stream(max_tokens=200)
    assert want[-1] == EOS and len(want) < 200  # the fake model reaches EOS first
    tokens, reasons, _ = drive_overlapped(sched, worker, {0: [req]})
    assert tokens["r"][0] == want and reasons["r"][0] == "stop"
    assert worker.ahead_steps > 0


def test_a_queued_request_is_not_kept_waiting_behind_steps_ahead():
    """Nothing is planned ahead while a request waits: it joins the step after the one in
    flight, as it would without overlap."""
    sched, worker, req, _ = single_stream(max_tokens=30, stop_ids=())
    late = Request("late", [20, 21, 22], SP(max_tokens=5, ignore_eos=True), 1.0)
    sched.add(req)
    for _ in range(8):  # into steady decoding, a step ahead in flight
        plan = sched.schedule(0.0)
        ahead = sched.schedule_ahead()
        sched.update(plan, worker.execute(plan), 0.0)
        if ahead is not None:
            break
    assert ahead is not None
    sched.add(late)
    assert sched.schedule_ahead() is None  # a request waits: nothing more ahead
    sched.update(ahead, worker.execute(ahead), 0.0)
    nxt = sched.schedule(0.0)
    assert [n.seq_id for n in nxt.new_seqs] == [sched.requests["late"].seqs[0].seq_id]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=config_st, specs=st.lists(request_st, min_size=1, max_size=10),
       stop_every=st.sampled_from([0, 0, 5]), window=st.sampled_from([0, 0, 0, 6]))
def test_overlapped_scheduling_gives_the_same_outputs(cfg, specs, stop_every, window):
    max_model_len = 48
    budget = cfg["max_num_seqs"] + cfg["extra_budget"]
    if not cfg["enable_chunked_prefill"]:
        budget = max(budget, max_model_len)
    runs = []
    for overlapped in (False, True):
        sched, worker = make_scheduler(
            cfg["num_gpu_blocks"], cfg["num_cpu_blocks"], eos=(EOS,), vocab=VOCAB,
            block_size=BLOCK, max_model_len=max_model_len, max_num_seqs=cfg["max_num_seqs"],
            max_num_batched_tokens=budget, enable_chunked_prefill=cfg["enable_chunked_prefill"],
            enable_prefix_caching=cfg["enable_prefix_caching"], policy=cfg["policy"],
            preemption_mode=cfg["preemption_mode"], sliding_window=window,
            swap_threshold_tokens=cfg["swap_threshold_tokens"], watermark=cfg["watermark"],
            max_queued_requests=10)
        arrivals = {}
        for i, spec in enumerate(specs):
            params = SP(max_tokens=spec["max_tokens"], ignore_eos=spec["ignore_eos"],
                        min_tokens=min(spec["min_tokens"], spec["max_tokens"]), n=spec["n"])
            arrivals.setdefault(spec["arrival"], []).append(Request(
                f"r{i}", _prompt(i, spec), params, float(spec["arrival"] * 100 + i),
                priority=spec["priority"]))
        if overlapped:
            stops = {t: True for t in range(stop_every - 1, 400, stop_every)} if stop_every else {}
            aborts = {}
            for i, spec in enumerate(specs):
                if spec["abort_at"] is not None:
                    aborts.setdefault(spec["abort_at"], []).append(f"r{i}")
            runs.append(drive_overlapped(sched, AheadWorker(worker), arrivals, aborts, stops))
        else:
            runs.append(drive_overlapped(sched, worker, arrivals, overlap=False))
        assert not sched.kv.seq_ids() and not sched.requests
    (want, want_reasons, _), (got, got_reasons, cut) = runs
    assert set(got) | cut >= set(want) - cut
    for rid, samples in want.items():
        for index, toks in samples.items():
            got_toks = got.get(rid, {}).get(index, [])
            if rid in cut:  # aborted or stopped: what came is the stream's beginning
                assert got_toks == toks[:len(got_toks)], (rid, index)
            else:
                assert (got_toks, got_reasons[rid][index]) == (toks, want_reasons[rid][index])
