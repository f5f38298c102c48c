"""Losing the workers' device KV cache: running sequences are recomputed, sequences swapped out
by completed steps come back from the surviving host pool, and every request still produces
exactly the tokens of an undisturbed run."""
from __future__ import annotations

from pagedserve.pipeline.sampling_params import SamplingParams
from pagedserve.pipeline.scheduler.sequence import Request, SequenceStatus
from sched_fakes import expected_tokens, make_scheduler


def _requests(n: int, max_tokens: int = 24) -> list[Request]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [Request(f"r{i}", [7 + i, 8, 9, 10 + i, 11, 12, 13], params, arrival_time=float(i))
            for i in range(n)]


def _lose_workers(sched, worker) -> None:
    """A worker restart: device bytes and worker state gone, host pool kept; the plan in
    flight is never answered."""
    sched.schedule(1e6)  # in flight when the workers died
    sched.reset_device_state()
    worker.gpu = [[None] * worker.bs for _ in worker.gpu]
    worker.seqs.clear()


def _finish(sched, worker, steps: int = 500) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    for t in range(steps):
        if not sched.has_unfinished():
            return got
        plan = sched.schedule(float(t))
        for out in sched.update(plan, worker.execute(plan), float(t)):
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    raise AssertionError("not finished")


def _tight_pool_with_requests():
    """Four requests in a device pool too small for all of them: swap preemption follows."""
    sched, worker = make_scheduler(num_gpu_blocks=9, num_cpu_blocks=40, block_size=4,
                                   preemption_mode="swap", max_num_seqs=8,
                                   max_num_batched_tokens=64)
    reqs = _requests(4)
    for r in reqs:
        sched.add(r)
    return sched, worker, reqs


def test_running_sequences_are_recomputed_and_swapped_ones_swap_back_in():
    sched, worker, reqs = _tight_pool_with_requests()
    got: dict[str, list[int]] = {}
    swapped_step = None
    for t in range(200):
        plan = sched.schedule(float(t))
        for out in sched.update(plan, worker.execute(plan), float(t)):
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        if sched.num_swapped:
            swapped_step = t
            break
    assert swapped_step is not None, "the pool was meant to force a swap-out"
    swapped = [s for s in sched.seqs.values() if s.status is SequenceStatus.SWAPPED]
    # One more step runs and completes, so its swap-outs are real; then the workers die.
    plan = sched.schedule(1000.0)
    for out in sched.update(plan, worker.execute(plan), 1000.0):
        got.setdefault(out.request_id, []).extend(out.new_token_ids)
    still_swapped = {s.seq_id for s in swapped if s.status is SequenceStatus.SWAPPED}
    _lose_workers(sched, worker)
    survivors = {s.seq_id for s in sched.seqs.values() if s.status is SequenceStatus.SWAPPED}
    assert survivors and survivors == {s for s in still_swapped if s in sched.seqs}
    assert sched.kv.stats().gpu_blocks_used == 0
    first = sched.schedule(2000.0)
    assert first.swap_in, "the surviving host copies come back by swap-in, not recompute"
    for out in sched.update(first, worker.execute(first), 2000.0):
        got.setdefault(out.request_id, []).extend(out.new_token_ids)
    rest = _finish(sched, worker)
    for r in reqs:
        tokens = got.get(r.request_id, []) + rest.get(r.request_id, [])
        assert tokens == expected_tokens(r.prompt_token_ids, 24, 1000), r.request_id
    assert sched.kv.stats().gpu_blocks_used == 0 and sched.kv.stats().cpu_blocks_used == 0


def test_swap_outs_of_the_lost_step_are_recomputed_not_trusted():
    sched, worker, reqs = _tight_pool_with_requests()
    got: dict[str, list[int]] = {}
    for t in range(200):
        plan = sched.schedule(float(t))
        if plan.swap_out:
            break  # this plan's swap-outs never reach the workers
        for out in sched.update(plan, worker.execute(plan), float(t)):
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    else:
        raise AssertionError("no swap-out happened")
    sched.reset_device_state()
    worker.gpu = [[None] * worker.bs for _ in worker.gpu]
    worker.seqs.clear()
    assert sched.num_swapped == 0  # nothing it holds on the host can be trusted
    rest = _finish(sched, worker)
    for r in reqs:
        tokens = got.get(r.request_id, []) + rest.get(r.request_id, [])
        assert tokens == expected_tokens(r.prompt_token_ids, 24, 1000), r.request_id
    assert sched.kv.stats().gpu_blocks_used == 0 and sched.kv.stats().cpu_blocks_used == 0


def _crashes_on(sched, worker, poison: str, steps: int = 500):
    """Drive the scheduler; every plan that computes `poison` "crashes the workers" (its
    result never comes; the workers restart). Returns tokens, failures, and the suspects each
    plan carried."""
    got, failed, suspects_per_plan = {}, {}, []
    for t in range(steps):
        if not sched.has_unfinished():
            return got, failed, suspects_per_plan
        plan = sched.schedule(float(t))
        planned = {seq.request.request_id for seq in sched._inflight.lanes + sched._inflight.seqs}
        suspects_per_plan.append(planned & set(sched.quarantine.suspects))
        if poison in planned:
            recovery = sched.reset_device_state("rank 0 raised", attributable=True)
            failed.update(recovery.failed)
            worker.gpu = [[None] * worker.bs for _ in worker.gpu]
            worker.seqs.clear()
            continue
        for out in sched.update(plan, worker.execute(plan), float(t)):
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    raise AssertionError("not finished")


def test_a_request_in_two_crashing_steps_is_failed_alone():
    sched, worker = make_scheduler(num_gpu_blocks=64, block_size=4, max_num_seqs=8)
    requests = _requests(6, max_tokens=12)
    for req in requests:
        sched.add(req)
    got, failed, suspects = _crashes_on(sched, worker, poison="r3")
    assert list(failed) == ["r3"]
    assert "in 2 steps in a row that crashed the worker group (last: rank 0 raised)" in failed["r3"]
    # every other request completes with exactly the tokens of an undisturbed run
    for req in requests:
        if req.request_id != "r3":
            assert got[req.request_id][-12:] == expected_tokens(req.prompt_token_ids, 12, 1000)
    assert all(len(s) <= 1 for s in suspects)  # suspects come back one at a time
    assert not sched.quarantine.suspects and sched.kv.stats().gpu_blocks_used == 0


def test_outside_kills_are_no_evidence_and_a_suspect_that_samples_is_cleared():
    sched, worker = make_scheduler(num_gpu_blocks=64, block_size=4, max_num_seqs=8)
    for req in _requests(3, max_tokens=8):
        sched.add(req)
    plan = sched.schedule(0.0)
    sched.update(plan, worker.execute(plan), 0.0)
    sched.schedule(1.0)  # in flight when a rank was SIGKILLed from outside
    assert sched.reset_device_state("worker0 was killed by SIGKILL").failed == []
    assert not sched.quarantine.suspects
    worker.gpu = [[None] * worker.bs for _ in worker.gpu]
    worker.seqs.clear()
    sched.schedule(2.0)  # in flight when a rank raised: all three are suspects now
    assert sched.reset_device_state("rank 0 raised", attributable=True).failed == []
    assert set(sched.quarantine.suspects) == {"r0", "r1", "r2"}
    worker.gpu = [[None] * worker.bs for _ in worker.gpu]
    worker.seqs.clear()
    assert _finish(sched, worker).keys() == {"r0", "r1", "r2"}
    assert not sched.quarantine.suspects and all(r.crashes == 0 for r in sched.requests.values())
