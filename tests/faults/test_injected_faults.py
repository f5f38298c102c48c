"""Faults injected with PAGEDSERVE_FAULT: hangs and exceptions in workers, the scheduler and the
detokenizer (each shown to have fired mid-stream: the role's pid changed while streams ran, the
restart counted), a poison request, a crash loop, a slow detokenizer."""
from __future__ import annotations

import time

import psutil
import pytest

from pagedserve.pipeline import SamplingParams
from pagedserve.pipeline.outputs import RequestError
from faults.conftest import GREEDY, Group, sampled, token_ids
from pagedserve.pipeline.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def batch(prompt_ids):
    """The 16 prompts each batch of these tests sends."""
    return prompt_ids[:16]


@pytest.fixture(scope="module")
def references(model_dir, batch):
    """What a group without faults gives: greedy and seeded-sampled outputs of the batch."""
    group = Group(model_dir)
    try:
        return {"greedy": token_ids(group.submit_all(batch)),
                "sampled": token_ids(group.submit_all(batch, sampled))}
    finally:
        assert group.close() == 0


def batches_until_every_fault_fired(group, prompt_ids, mode, roles, reference, max_batches=6):
    """Submit the batch again and again until every role in `roles` ran as a new process
    (its fault fired): each batch must equal the reference, and each fault must have fired
    while that batch's streams were in flight. Returns the batches run and the restarts."""
    params = GREEDY if mode == "greedy" else sampled
    first = group.pids(roles)
    fired: dict[str, int] = {}
    for batch in range(1, max_batches + 1):
        futures = group.submit_all(prompt_ids, params)
        while not all(f.done() for f in futures):
            for role, pid in group.pids(roles).items():
                if role not in fired and pid is not None and pid != first[role]:
                    fired[role] = batch
                    # the new process exists before the streams finished: they were in flight
                    assert not all(f.done() for f in futures), role
            time.sleep(0.02)
        assert token_ids(futures) == reference, f"batch {batch} differs from the clean run"
        for role in roles:  # a death seen only after the batch ended counts for it too
            pid = group.pids(roles)[role]
            if role not in fired and (pid is None or pid != first[role]):
                fired[role] = batch
        if len(fired) == len(roles):
            break
    assert set(fired) == set(roles), f"faults that never fired: {set(roles) - set(fired)}"
    for role in roles:
        group.wait_restarted(role, first[role])
    return batch, group.restarts()


@pytest.mark.parametrize("fault, mode, roles", [
    # a worker raising, then the detokenizer hanging (its heartbeats stop)
    ("worker0:raise@step=12;detokenizer:hang@msg=100", "greedy", ("worker0", "detokenizer")),
    # the scheduler raising, then the detokenizer raising; seeded sampling
    ("scheduler:raise@step=12;detokenizer:raise@msg=100", "sampled",
     ("scheduler", "detokenizer")),
    # the scheduler hanging, then a worker hanging (caught by --step-timeout); seeded sampling
    ("scheduler:hang@step=12;worker0:hang@step=30", "sampled", ("scheduler", "worker0")),
])
def test_faults_fire_mid_stream_and_lose_nothing(model_dir, batch, references, fault, mode, roles):
    # a hung worker is caught by --step-timeout: 8 s (steps here take ~50 ms) rather than 20
    group = Group(model_dir, fault=fault, extra=("--step-timeout", "8"))
    try:
        batches, restarts = batches_until_every_fault_fired(group, batch, mode, roles,
                                                            references[mode])
        for role in roles:  # the scheduler's count starts again when it restarts itself
            counted = restarts.get("worker" if role.startswith("worker") else role, 0)
            assert counted >= 1 or (role != "scheduler" and "scheduler" in roles), (role, restarts)
        if "scheduler" in roles:
            assert restarts.get("scheduler") == 1
        assert group.blocks_in_use() == 0
        assert token_ids(group.submit_all(batch, GREEDY if mode == "greedy" else sampled)
                         ) == references[mode]
    finally:
        assert group.close() == 0
    assert group.leftovers() == []


def test_a_poison_request_is_failed_alone_and_the_others_complete(model_dir, batch, references):
    """A request whose prompt makes a worker raise (a fault keyed on one of its token ids, in
    every incarnation) is failed after two crashes; the rest finish as in a clean run."""
    poison = 31337
    group = Group(model_dir, fault=f"worker0:raise@token={poison}!")
    try:
        first = group.pids(["worker0"])["worker0"]
        futures = group.submit_all(batch)
        bad = group.client.submit(batch[0][:3] + [poison] + batch[0][3:], GREEDY)
        with pytest.raises(RequestError) as info:
            bad.result(300)
        assert info.value.status == 500
        assert "2 steps in a row that crashed the worker group" in info.value.message
        assert token_ids(futures) == references["greedy"]
        group.wait_restarted("worker0", first)
        assert group.restarts()["worker"] == 2
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
