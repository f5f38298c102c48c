"""Faults injected with PAGEDSERVE_FAULT: hangs and exceptions in workers and the scheduler,
a crash loop, a slow detokenizer."""
from __future__ import annotations

import time

import psutil
import pytest

from pagedserve.pipeline import SamplingParams
from pagedserve.pipeline.outputs import RequestError
from tests.faults.conftest import Group, token_ids
from pagedserve.pipeline.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow


def run_reference_then_faulted(group, prompt_ids):
    """The first batch runs before the fault's step; the second is hit by it mid-stream."""
    reference = token_ids(group.submit_all(prompt_ids))
    faulted = token_ids(group.submit_all(prompt_ids))
    return reference, faulted


@pytest.mark.parametrize("fault", [
    # a worker raising, then (after recovery) the scheduler hanging
    "worker0:raise@step=30;scheduler:hang@step=75",
    # a worker hanging (caught by --step-timeout), then the scheduler raising
    "worker0:hang@step=30;scheduler:raise@step=75",
])
def test_hang_and_raise_lose_nothing(model_dir, prompt_ids, fault):
    group = Group(model_dir, fault=fault)
    try:
        reference, after_worker_fault = run_reference_then_faulted(group, prompt_ids)
        assert after_worker_fault == reference
        group.wait_healthy(120)
        assert group.blocks_in_use() == 0
        # the third batch meets the scheduler fault; the clients resubmit to its successor
        assert token_ids(group.submit_all(prompt_ids)) == reference
        group.wait_healthy(120)
        assert group.blocks_in_use() == 0
    finally:
        assert group.close() == 0
    assert group.leftovers() == []


def test_crash_loop_gives_up_with_a_clear_error_and_leaves_nothing(model_dir, prompt_ids):
    group = Group(model_dir, fault="worker0:crash@step=3!",
                  extra=("--max-restarts", "1", "--restart-window", "120"))
    futures = group.submit_all(prompt_ids[:4])
    errors = []
    for f in futures:
        with pytest.raises(RequestError) as info:
            f.result(180)
        errors.append(info.value)
    gave_up_at = time.monotonic()
    assert all(e.status == 503 for e in errors)
    assert all("worker" in e.message and "crash loop" in e.message for e in errors)
    assert group.proc.wait(10) != 0
    assert time.monotonic() - gave_up_at < 10
    group.client.close()
    assert group.leftovers() == []


def test_slow_detokenizer_completes_in_order_with_bounded_memory(model_dir, prompt_ids):
    slow = Group(model_dir, fault="detokenizer:slow=50")
    tokenizer = load_tokenizer(model_dir)
    try:
        detok = psutil.Process(slow.pid_of("detokenizer"))
        rss_before = detok.memory_info().rss
        outs = [f.result(600).outputs[0] for f in slow.submit_all(prompt_ids)]
        # every stream complete, its text assembled in order from the deltas
        assert all(len(o.token_ids) == 20 for o in outs)
        assert [o.text for o in outs] == [tokenizer.decode(o.token_ids, skip_special_tokens=True)
                                          for o in outs]
        assert detok.memory_info().rss - rss_before < 64 * 2**20
    finally:
        assert slow.close() == 0


def test_worker_dying_during_a_drain_fails_the_rest_instead_of_hanging(model_dir, prompt_ids):
    import signal
    group = Group(model_dir)
    long = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)
    futures = [group.client.submit(ids, long) for ids in prompt_ids[:4]]
    group.wait_tokens(4 * 3)
    group.proc.send_signal(signal.SIGTERM)  # drain: the 4 requests would run for minutes
    time.sleep(0.5)
    group.kill("worker0")
    for f in futures:
        with pytest.raises(RequestError, match="worker0.*draining"):
            f.result(60)
    assert group.proc.wait(30) != 0
    group.client.close()
    assert group.leftovers() == []
