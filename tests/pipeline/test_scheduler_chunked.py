"""A long prompt arriving while 8 sequences decode is chunked around them."""
from pagedserve.pipeline.sampling_params import SamplingParams as SP
from pagedserve.pipeline.scheduler.sequence import Request
from sched_fakes import expected_tokens, make_scheduler, step


def test_long_prompt_is_chunked_around_running_decodes():
    sched, worker = make_scheduler(200, block_size=4, max_num_seqs=16, max_num_batched_tokens=16)
    for i in range(8):
        sched.add(Request(f"d{i}", [i + 1, i + 2, i + 3], SP(max_tokens=40), arrival_time=i))
    step(sched, worker)  # 8 prompts of 3 tokens: 24 > 16, so two steps of prefill
    step(sched, worker)
    long_prompt = list(range(100, 200))
    sched.add(Request("long", long_prompt, SP(max_tokens=3), arrival_time=10))
    long_id = None
    chunks = []
    while True:
        plan, out = step(sched, worker)
        by_id = {s.seq_id: s.num_tokens for s in plan.seq_steps()}
        assert sum(by_id.values()) <= 16
        decodes = {sid: n for sid, n in by_id.items() if sid < 8}
        assert decodes == {sid: 1 for sid in range(8)}  # every stream gains a token each step
        assert len([o for o in out if o.request_id.startswith("d")]) == 8
        long_id = 8
        if long_id in by_id:
            chunks.append(by_id[long_id])
        if any(o.request_id == "long" for o in out):
            break
    assert chunks == [8] * 12 + [4]  # the 8 slots the decodes leave, every step
    assert sched.stats().iteration_tokens == 12
    tokens = [o.new_token_ids for o in out if o.request_id == "long"]
    assert tokens == [expected_tokens(long_prompt, 1, worker.vocab)]
