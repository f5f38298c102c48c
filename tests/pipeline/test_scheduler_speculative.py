"""N-gram speculation in the scheduler, against the fake worker (sched_fakes.py), whose model
mostly copies the token five back so that drafts are often right and sometimes wrong: the same
tokens as without drafts, across stops, max_tokens, preemption, swap, aborts and a lost worker
group; drafts only where they may be; the proposer against a brute-force lookup."""
import random

import pytest

from pagedserve.pipeline.sampling_params import SamplingParams as SP
from pagedserve.pipeline.scheduler.sequence import Request
from pagedserve.pipeline.scheduler.speculative import NgramIndex
from pagedserve.pipeline.speculative_config import SpeculativeConfig
from pagedserve.pipeline.structured.spec import StructuredOutputs
from sched_fakes import copying_next_token, drive, expected_tokens, make_scheduler

VOCAB = 50
EOS = 7


def _prompt(seed: int, length: int = 20) -> list[int]:
    rng = random.Random(seed)
    base = [rng.randrange(8, VOCAB) for _ in range(5)]
    return (base * (length // 5 + 1))[:length]


def _sched(num_gpu_blocks=64, num_cpu_blocks=0, k=4, low=1, high=3, batch=0, **config):
    config.setdefault("block_size", 4)
    config.setdefault("max_num_batched_tokens", 64)
    config.setdefault("max_num_seqs", 8)
    return make_scheduler(num_gpu_blocks, num_cpu_blocks, eos=(EOS,), vocab=VOCAB,
                          model=copying_next_token,
                          speculative=SpeculativeConfig("ngram", k, low, high, batch), **config)


def _want(prompt, params):
    stop = () if params.ignore_eos else (EOS,)
    return expected_tokens(prompt, params.max_tokens, VOCAB, 0, stop, params.min_tokens,
                           model=copying_next_token)


def _drafts_of(plans, seq_id=None):
    return [s.draft_token_ids for p in plans for s in p.scheduled
            if s.draft_token_ids and (seq_id is None or s.seq_id == seq_id)]


def test_brute_force_lookup_agrees_with_the_incremental_index():
    rng = random.Random(0)
    for trial in range(200):
        low = rng.randint(1, 3)
        high = rng.randint(low, 4)
        tokens, index = [], NgramIndex()
        for _ in range(rng.randint(1, 60)):
            tokens += [rng.randrange(4)] * rng.choice([1, 1, 1, 2])
            k = rng.randint(1, 5)
            assert index.propose(tokens, k, low, high) == _brute_force(tokens, k, low, high), \
                (trial, tokens)


def _brute_force(tokens, k, low, high):
    """The longest suffix (high down to low) that occurred before; what followed its latest
    earlier occurrence."""
    size = len(tokens)
    for n in range(min(high, size), low - 1, -1):
        suffix = tokens[size - n:]
        for end in range(size - 1, n - 1, -1):
            if tokens[end - n:end] == suffix:
                return tokens[end:end + k]
    return []


def test_drafts_give_the_tokens_decoding_one_at_a_time_gives_in_fewer_steps():
    prompts = [_prompt(i) for i in range(4)]
    params = SP(max_tokens=60, ignore_eos=True)
    sched, worker = _sched()
    for i, p in enumerate(prompts):
        sched.add(Request(f"r{i}", p, params))
    tokens, reasons, plans = drive(sched, worker)
    for i, p in enumerate(prompts):
        assert tokens[f"r{i}"][0] == _want(p, params) and reasons[f"r{i}"] == {0: "length"}
    drafted = sum(d for d, _ in worker.verified)
    accepted = sum(a for _, a in worker.verified)
    assert 0 < accepted < drafted  # some right, some wrong
    assert (sched.spec_draft_tokens, sched.spec_accepted_tokens) == (drafted, accepted)
    assert sched.spec_num_drafts == len(worker.verified)
    assert sum(sched.spec_accepted_per_pos) == accepted
    assert sched.generation_tokens == 4 * 60
    assert len(plans) < 60  # accepted drafts saved steps
    assert sched.kv.stats().gpu_blocks_used == 0 and not sched.proposer.indexes
    for p in plans:  # budget: every draft counts
        assert sum(s.num_tokens + len(s.draft_token_ids) for s in p.seq_steps()) <= 64


def test_a_stop_id_among_accepted_drafts_ends_the_sample_there():
    # EOS recurs in the prompts, so drafts carry it; tokens after the one that stops are dropped
    stopped_in_drafts = 0
    for seed in range(40):
        prompt = _prompt(seed, 9) + [EOS]
        prompt = prompt * 3
        params = SP(max_tokens=40, min_tokens=seed % 3 * 4)
        sched, worker = _sched(k=6, low=2, high=3)
        sched.add(Request("a", prompt, params))
        tokens, reasons, plans = drive(sched, worker)
        want = _want(prompt, params)
        assert tokens["a"][0] == want
        assert reasons == {"a": {0: "stop" if want[-1] == EOS else "length"}}
        stopped_in_drafts += any(EOS in d for d in worker.accepted_drafts)
    assert stopped_in_drafts >= 3

def test_drafts_never_pass_max_tokens_or_the_model_length():
    prompt = _prompt(3)
    for max_tokens in (1, 2, 5, 13):
        params = SP(max_tokens=max_tokens, ignore_eos=True)
        sched, worker = _sched(k=8)
        sched.add(Request("a", prompt, params))
        tokens, reasons, plans = drive(sched, worker)
        assert tokens["a"][0] == _want(prompt, params) and reasons == {"a": {0: "length"}}
        for p in plans:
            for s in p.scheduled:
                if s.draft_token_ids:  # computed + drafts + the token after them fit
                    assert len(s.draft_token_ids) <= max_tokens - 1
    sched, worker = _sched(k=8, max_model_len=32)
    sched.add(Request("b", prompt, SP(max_tokens=12, ignore_eos=True)))
    tokens, _, plans = drive(sched, worker)
    assert len(tokens["b"][0]) == 12
    assert all(max(p.num_tokens for p in plans) <= 32 for _ in [0])


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_and_swap_keep_the_tokens(mode):
    prompts = [_prompt(i, 12) for i in range(5)]
    params = SP(max_tokens=40, ignore_eos=True)
    sched, worker = _sched(num_gpu_blocks=40, num_cpu_blocks=64 if mode == "swap" else 0,
                           preemption_mode=mode, max_num_seqs=5)
    for i, p in enumerate(prompts):
        sched.add(Request(f"r{i}", p, params))
    tokens, _, plans = drive(sched, worker)
    assert sched.num_preemptions > 0 and (mode != "swap" or any(p.swap_out for p in plans))
    assert sched.spec_accepted_tokens > 0
    for i, p in enumerate(prompts):
        assert tokens[f"r{i}"][0] == _want(p, params)


def test_a_lost_worker_group_and_an_abort_mid_speculation():
    prompts = [_prompt(i) for i in range(3)]
    params = SP(max_tokens=50, ignore_eos=True)
    sched, worker = _sched()
    for i, p in enumerate(prompts):
        sched.add(Request(f"r{i}", p, params))
    got = {f"r{i}": [] for i in range(3)}
    lost = aborted = False
    for step_no in range(500):
        if not sched.has_unfinished():
            break
        plan = sched.schedule(float(step_no))
        if plan.scheduled and any(s.draft_token_ids for s in plan.scheduled) and not lost \
                and sched.spec_accepted_tokens:
            lost = True  # the step with drafts is lost with the workers
            sched.reset_device_state("killed")
            worker.seqs.clear()
            continue
        if lost and not aborted and any(s.draft_token_ids and s.seq_id == 2
                                        for s in plan.scheduled):
            aborted = True  # its step is in flight: its row is no longer wanted
            assert [o.finish_reason for o in sched.abort("r2")] == ["abort"]
        for out in sched.update(plan, worker.execute(plan), float(step_no)):
            got[out.request_id] += out.new_token_ids
    assert lost and aborted
    for i in range(2):
        assert got[f"r{i}"] == _want(prompts[i], params)
    assert got["r2"] == _want(prompts[2], params)[:len(got["r2"])]
    assert sched.kv.stats().gpu_blocks_used == 0


def test_only_requests_that_may_speculate_get_drafts():
    prompt = _prompt(1)
    schema = StructuredOutputs(regex="[0-9]+")
    kinds = {"plain": SP(max_tokens=30, ignore_eos=True),
             "penalties": SP(max_tokens=30, ignore_eos=True, presence_penalty=0.5),
             "logprobs": SP(max_tokens=30, ignore_eos=True, logprobs=1),
             "structured": SP(max_tokens=30, ignore_eos=True, structured_outputs=schema)}
    sched, worker = _sched()
    for rid, params in kinds.items():
        sched.add(Request(rid, prompt, params))
    assert [rid for rid, r in sched.requests.items() if r.speculates] == ["plain"]
    ids = {rid: r.seqs[0].seq_id for rid, r in sched.requests.items()}
    sched.grammar_book = None  # the fake worker applies no masks: only the planning is checked
    tokens, _, plans = drive(sched, worker)
    assert _drafts_of(plans, ids["plain"])
    for rid in ("penalties", "logprobs", "structured"):
        assert not _drafts_of(plans, ids[rid])
    assert tokens["plain"][0] == _want(prompt, kinds["plain"])


def test_no_drafts_while_the_batch_is_larger_than_disable_by_batch_size():
    sched, worker = _sched(batch=2)
    for i in range(3):
        sched.add(Request(f"r{i}", _prompt(i), SP(max_tokens=10 + 20 * i, ignore_eos=True)))
    _, _, plans = drive(sched, worker)
    for plan in plans:
        running = len(plan.seq_steps())
        if running > 2:
            assert not any(s.draft_token_ids for s in plan.scheduled)
    assert _drafts_of(plans)  # once two had finished, the last one drafted
