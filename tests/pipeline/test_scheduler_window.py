"""A sliding-window model (every layer attends the last W positions): the scheduler releases
the blocks that slid out of the window while a sequence runs, so a sequence needs its window,
not its length, and every step's tokens are the ones an undisturbed windowed run gives (the fake
worker reads only the window, and checks what it reads)."""
from __future__ import annotations

import pytest
from pagedserve.pipeline.sampling_params import SamplingParams as SP
from pagedserve.pipeline.scheduler import RequestRejected
from pagedserve.pipeline.scheduler.sequence import Request, SequenceStatus
from sched_fakes import drive, expected_tokens, make_scheduler, step

BS, W = 4, 8
PROMPT = [5, 6, 7, 8, 9, 10]
LONG = 4 * W  # tokens generated: 4x the window


def _windowed(num_gpu_blocks, num_cpu_blocks=0, **config):
    config.setdefault("max_model_len", 64)
    config.setdefault("max_num_batched_tokens", 8)
    config.setdefault("max_num_seqs", 4)
    return make_scheduler(num_gpu_blocks, num_cpu_blocks, block_size=BS, sliding_window=W,
                          **config)


def _params(max_tokens=LONG, **kw):
    return SP(max_tokens=max_tokens, ignore_eos=True, **kw)


def _peak_check(limit):
    """A drive() check: blocks in use after every schedule, against `limit`."""
    peaks = []

    def check(sched, plan):
        used = sched.kv.stats().gpu_blocks_used
        peaks.append(used)
        assert used <= limit, (plan.step_id, used)
    return check, peaks


def test_a_long_generation_holds_only_its_window_and_the_pool_empties():
    sched, worker = _windowed(5, enable_prefix_caching=False)
    sched.add(Request("r", PROMPT, _params()))
    check, peaks = _peak_check(W // BS + 2)
    tokens, reasons, plans = drive(sched, worker, check=check)
    assert tokens["r"][0] == expected_tokens(PROMPT, LONG, worker.vocab, window=W)
    assert reasons == {"r": {0: "length"}}
    assert max(peaks) == 3 and sched.kv.stats().gpu_blocks_used == 0
    # The table grows by one block per 4 positions; released blocks come back at once (the
    # uncached ones go to the head of the free queue), so ids cycle through 0, 1, 2.
    sent = plans[0].new_seqs[0].block_ids + [b for p in plans for s in p.seq_steps()
                                              for b in s.new_block_ids]
    assert sent == [0, 1, 2, 0, 1, 2, 0, 1, 2, 0]
    assert all(not p.new_seqs for p in plans[1:])  # releasing never resends a sequence


def test_admission_counts_the_window_not_the_length():
    sched, _ = _windowed(5)
    sched.add(Request("fits", PROMPT, _params()))  # 38 tokens = 10 blocks > 5
    plain, _ = make_scheduler(5, block_size=BS, max_model_len=64, max_num_batched_tokens=8,
                              max_num_seqs=4)
    with pytest.raises(RequestRejected, match="needs 10 blocks of 4 tokens but the KV cache "
                                              "has only 5 usable blocks"):
        plain.add(Request("too-long", PROMPT, _params()))
    small, _ = _windowed(3)
    with pytest.raises(RequestRejected, match=r"needs 5 blocks of 4 tokens \(a sliding window "
                                              r"of 8 and chunks of up to 8\) but the KV cache "
                                              r"has only 3"):
        small.add(Request("r", PROMPT, _params()))


def test_a_model_without_a_window_keeps_every_block():
    sched, worker = make_scheduler(12, block_size=BS, max_model_len=64,
                                   max_num_batched_tokens=8, max_num_seqs=4)
    sched.add(Request("r", PROMPT, _params()))
    check, peaks = _peak_check(10)
    tokens, _, plans = drive(sched, worker, check=check)
    assert tokens["r"][0] == expected_tokens(PROMPT, LONG, worker.vocab)
    assert max(peaks) == 10 and sched.kv.num_free_blocks == 12
    assert sorted(b for p in plans for s in p.seq_steps() for b in s.new_block_ids) + \
        plans[0].new_seqs[0].block_ids == [2, 3, 4, 5, 6, 7, 8, 9, 0, 1]


def test_a_long_prompt_is_prefilled_in_chunks_within_the_window():
    prompt = list(range(10, 40))  # 30 tokens, chunks of 8
    sched, worker = _windowed(6)
    sched.add(Request("r", prompt, _params(max_tokens=12)))
    check, _ = _peak_check(5)  # 7 keys before a chunk of 8: at most 5 blocks
    tokens, _, plans = drive(sched, worker, check=check)
    assert [s.num_tokens for s in plans[1].seq_steps()] == [8]
    assert tokens["r"][0] == expected_tokens(prompt, 12, worker.vocab, window=W)
    assert sched.kv.stats().gpu_blocks_used == 0


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_a_preempted_windowed_sequence_resumes(mode):
    sched, worker = _windowed(7, 8, policy="priority", preemption_mode=mode)
    for rid in ("low1", "low2"):
        sched.add(Request(rid, PROMPT, _params(), priority=5))
    for _ in range(21):
        step(sched, worker)  # both are well past their window, holding 6 blocks of 7
    assert sched.kv.num_free_blocks == 1
    low1, low2 = (sched.requests[rid].seqs[0] for rid in ("low1", "low2"))
    assert sched.kv.num_released_blocks(low2.seq_id) == 4
    high = list(range(60, 80))
    sched.add(Request("high", high, _params(max_tokens=4), priority=0))
    plan, _ = step(sched, worker)
    assert sched.num_preemptions == 1
    if mode == "swap":
        # only the blocks its next step reads go to the host pool, not its 7 table entries
        assert low2.status is SequenceStatus.SWAPPED and len(plan.swap_out) == 3
        assert len(sched.kv.block_table(low2.seq_id)) == 7
    else:
        assert plan.swap_out == [] and low2.status is SequenceStatus.WAITING
    tokens, reasons, _ = drive(sched, worker)
    assert reasons == {"low1": {0: "length"}, "low2": {0: "length"}, "high": {0: "length"}}
    assert tokens["high"][0] == expected_tokens(high, 4, worker.vocab, window=W)
    for low in (low1, low2):
        assert sched_tokens(low) == expected_tokens(PROMPT, LONG, worker.vocab, window=W)
    assert sched.kv.stats().gpu_blocks_used == sched.kv.stats().cpu_blocks_used == 0


def test_a_sequence_swapped_out_past_a_pool_of_blocks_comes_back():
    """Found by Hypothesis: swap-in counted the blocks the window had released as ones its next
    token still needed, so a sequence whose table outgrew the pool never came back."""
    sched, worker = _windowed(7, 8, policy="priority", preemption_mode="swap")
    for rid in ("low1", "low2"):
        sched.add(Request(rid, PROMPT, _params(), priority=5))
    for _ in range(26):
        step(sched, worker)
    low2 = sched.requests["low2"].seqs[0]
    assert len(sched.kv.block_table(low2.seq_id)) > 7  # its table is longer than the pool
    high = list(range(60, 80))
    sched.add(Request("high", high, _params(max_tokens=4), priority=0))
    step(sched, worker)
    assert low2.status is SequenceStatus.SWAPPED
    tokens, reasons, _ = drive(sched, worker, max_steps=200)
    assert reasons == {"low1": {0: "length"}, "low2": {0: "length"}, "high": {0: "length"}}
    assert sched_tokens(low2) == expected_tokens(PROMPT, LONG, worker.vocab, window=W)


def sched_tokens(seq):
    return seq.token_ids[seq.num_prompt_tokens:]


def test_forked_samples_release_their_shared_blocks_independently():
    sched, worker = make_scheduler(8, block_size=BS, sliding_window=W, max_model_len=64,
                                   max_num_batched_tokens=8, max_num_seqs=4,
                                   salt_of=lambda sid: sid)
    sched.add(Request("r", PROMPT, _params(n=2)))
    check, _ = _peak_check(2 * (W // BS + 2))
    tokens, _, plans = drive(sched, worker, check=check)
    for index in (0, 1):
        assert tokens["r"][index] == expected_tokens(PROMPT, LONG, worker.vocab, salt=index,
                                                     window=W)
    assert any(p.copy for p in plans)  # the shared partial block was copied on write
    assert sched.kv.stats().gpu_blocks_used == 0


def test_recovery_recomputes_a_windowed_sequence():
    sched, worker = _windowed(6)
    sched.add(Request("r", PROMPT, _params()))
    got = []
    for _ in range(18):
        _, outs = step(sched, worker)
        got += [t for o in outs for t in o.new_token_ids]
    sched.schedule(1e6)  # in flight when the workers died
    assert sched.reset_device_state().recomputed == 1
    worker.gpu = [[None] * BS for _ in worker.gpu]
    worker.seqs.clear()
    tokens, _, _ = drive(sched, worker)
    assert got + tokens["r"][0] == expected_tokens(PROMPT, LONG, worker.vocab, window=W)
    assert sched.kv.stats().gpu_blocks_used == 0


def test_a_prefix_hit_takes_only_the_window_of_a_cached_prompt():
    prompt = list(range(10, 30))  # 20 tokens: 4 full blocks cached after the first request
    sched, worker = _windowed(8, enable_prefix_caching=True, max_num_batched_tokens=32)
    sched.add(Request("a", prompt, _params(max_tokens=2)))
    drive(sched, worker)
    sched.add(Request("b", prompt, _params(max_tokens=2)))
    plan, _ = step(sched, worker)
    new = plan.new_seqs[0]
    assert new.num_computed_tokens == 16 and len(new.block_ids) == 5
    # Keys from 9 on: blocks 0 and 1 stay placeholders (cached, free, not taken).
    assert sched.kv.num_released_blocks(new.seq_id) == 2
    assert sched.kv.stats().gpu_blocks_used == 3
    tokens, _, _ = drive(sched, worker)
    assert tokens["b"][0] == expected_tokens(prompt, 2, worker.vocab, window=W)[1:]
    assert sched.kv.stats().gpu_blocks_used == 0
