"""Issue 38: a grammar compile is stopped at its limits (wall time, CPU time, memory), the
request hears which, and the next structured request does not wait behind it.

The hostile spec is a regex the ingress accepts (160 KB, under MAX_SPEC_CHARS; it parses in
milliseconds) that takes xgrammar ~25 s and ~300 MB to compile against the test model's
49,152-token vocabulary: 20,000 character classes in a row. Compiles used to run in threads,
which a timeout cannot stop: two such requests held both threads for as long as they ran.
Nothing here asserts a duration shorter than the configured timeout; order and completion are
asserted instead."""
from __future__ import annotations

import time

import psutil
import pytest

from pagedserve.pipeline.structured.compiler import CompileLimits, GrammarCompiler
from pagedserve.pipeline.structured.gate import GrammarGate
from pagedserve.pipeline.structured.spec import StructuredOutputs as S
from pagedserve.workers.loader import TEST_MODEL, resolve_model

TIMEOUT_S = 3.0
HOSTILE = S(regex="[a-z0-9]" * 20_000)
SIMPLE = S.from_json_schema({"type": "object", "properties": {"city": {"type": "string"}},
                             "required": ["city"]})


def compiler(limits: CompileLimits) -> GrammarCompiler:
    from pagedserve.pipeline.tokenizer import load_tokenizer
    model = str(resolve_model(TEST_MODEL))
    tokenizer = load_tokenizer(model)
    return GrammarCompiler(model, len(tokenizer), [tokenizer.eos_token_id], limits=limits)


@pytest.fixture(scope="module")
def warm_pair():
    """Two compile processes, started (a start imports xgrammar and torch: seconds)."""
    pair = compiler(CompileLimits(timeout_s=TIMEOUT_S, processes=2))
    for future in [pair.submit(S(regex=f"warm{k}")) for k in range(2)]:
        future.result(timeout=300)
    assert len(pair.process_ids) == 2
    yield pair
    pair.close()


def gone(pid: int) -> bool:
    return not psutil.pid_exists(pid)


def test_the_hostile_spec_passes_the_ingress_checks():
    HOSTILE.check()  # so only the compile's limits stand between it and the compile threads


def test_a_compile_past_the_timeout_is_stopped_and_the_next_spec_compiles(warm_pair):
    before = set(warm_pair.process_ids)
    hostile = warm_pair.submit(HOSTILE)
    simple = warm_pair.submit(SIMPLE)
    assert simple.result(timeout=TIMEOUT_S) is not None
    assert not hostile.done()  # the simple spec did not wait behind the hostile one
    with pytest.raises(ValueError, match=f"grammar compilation exceeded {TIMEOUT_S:g} s"):
        hostile.result(timeout=10 * TIMEOUT_S)
    stopped = before - set(warm_pair.process_ids)
    assert len(stopped) == 1 and all(gone(pid) for pid in stopped)  # killed, and reaped
    assert warm_pair.submit(S(regex="[0-9]+ then")).result(timeout=300) is not None


def test_the_gate_rejects_the_hostile_request_and_admits_the_next(warm_pair):
    """What the scheduler service sees: the simple request is admitted while the hostile one
    still waits; the hostile one is then failed naming the limit, its compile stopped."""
    gate = GrammarGate(warm_pair)
    seen = set(warm_pair.process_ids)  # a slot whose process was stopped before starts afresh
    gate.hold("hostile", S(regex="[0-9a-z]" * 20_000), "h")
    gate.hold("simple", S(regex="[a-z]+@[a-z]+"), "s")
    events = []
    while gate.held:
        seen |= set(warm_pair.process_ids)
        ready, failed = gate.release()
        events += [("ready", h.request_id) for h in ready]
        events += [("failed", h.request_id, why) for h, why in failed]
        time.sleep(0.01)
    assert events[0] == ("ready", "simple")
    assert events[1][:2] == ("failed", "hostile") and f"{TIMEOUT_S:g}" in events[1][2]
    for _ in range(int(10 * TIMEOUT_S / 0.05)):  # the kill follows the gate's timeout
        if seen - set(warm_pair.process_ids):
            break
        time.sleep(0.05)
    stopped = seen - set(warm_pair.process_ids)
    assert len(stopped) == 1 and all(gone(pid) for pid in stopped)


@pytest.mark.parametrize("limits, cause", [
    (CompileLimits(timeout_s=120, cpu_s=1, processes=1), "exceeded its CPU time limit of 1 s"),
    (CompileLimits(timeout_s=120, memory_mb=64, processes=1), "exceeded its memory limit of 64 MiB"),
])
def test_cpu_and_memory_limits_stop_the_compile_naming_the_cause(limits, cause):
    bounded = compiler(limits)
    try:
        assert bounded.submit(S(regex="warm")).result(timeout=300) is not None
        [pid] = bounded.process_ids
        with pytest.raises(ValueError, match=cause):
            bounded.submit(HOSTILE).result(timeout=120)
        assert gone(pid)
        assert bounded.submit(SIMPLE).result(timeout=300) is not None  # a fresh process
    finally:
        bounded.close()


def test_a_queued_compile_no_request_waits_for_is_not_run(warm_pair):
    """Abandoned specs (their requests timed out or were aborted) leave the queue."""
    gate = GrammarGate(warm_pair)
    for k in range(2):  # both processes busy
        gate.hold(f"busy{k}", S(regex=f"busy{k}" + "[a-z0-9]" * 20_000), None)
    gate.hold("abandoned", S(regex="abandoned[0-9]"), None)
    future = gate.held["abandoned"].future
    assert gate.drop("abandoned")
    assert future.cancelled()
    for k in range(2):
        gate.drop(f"busy{k}")
