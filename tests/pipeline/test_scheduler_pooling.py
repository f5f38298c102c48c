"""Embedding requests through the scheduler: prefill-only, batched with generations, finished
with their vector on the step that completes the prompt, blocks freed at once; a pooling that
reads every token is never split and never starts from cached blocks."""
from __future__ import annotations

import pytest

from pagedserve.pipeline.pooling import PoolingParams
from pagedserve.pipeline.sampling_params import SamplingParams
from pagedserve.pipeline.scheduler import RequestRejected
from pagedserve.pipeline.scheduler.sequence import Request

from sched_fakes import drive, expected_tokens, fake_embedding, make_scheduler, step

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def embed_request(rid, prompt):
    return Request(rid, prompt, SamplingParams(max_tokens=None), pooling=PoolingParams())


def drive_collecting(sched, worker, **kwargs):
    """drive(), also keeping each finished embedding (request id -> vector)."""
    vectors = {}
    real_update = sched.update

    def update(plan, result, now):
        outputs = real_update(plan, result, now)
        for out in outputs:
            if out.embedding is not None:
                vectors[out.request_id] = out.embedding
        return outputs
    sched.update = update
    tokens, reasons, plans = drive(sched, worker, **kwargs)
    return tokens, reasons, plans, vectors


def test_embedding_and_generation_share_steps():
    sched, worker = make_scheduler(40, max_num_batched_tokens=32, max_num_seqs=8)
    gen_prompt, doc = list(range(1, 21)), list(range(100, 150))
    sched.add(Request("gen", gen_prompt, GREEDY))
    sched.add(embed_request("emb", doc))
    tokens, reasons, plans, vectors = drive_collecting(sched, worker)
    assert tokens["gen"][0] == expected_tokens(gen_prompt, 6, 1000)
    assert reasons["emb"] == {0: "stop"} and tokens["emb"] == {0: []}
    assert vectors == {"emb": fake_embedding(doc)}
    # LAST pooling may be chunked: its last chunk shared a step with the generation's decode
    emb_id = next(n.seq_id for p in plans for n in p.new_seqs if n.pool)
    assert sum(n for sid, n in worker.pooled_steps if sid == emb_id) <= 32
    assert any(emb_id in [s.seq_id for s in p.scheduled] and p.num_scheduled > 1 for p in plans)
    assert all(emb_id not in p.decode_seq_ids for p in plans)  # never a decode lane
    assert sched.kv.num_free_blocks == 40 and not sched.requests


def test_last_pooling_reads_the_prefix_cache():
    sched, worker = make_scheduler(40, max_num_batched_tokens=64, max_num_seqs=8)
    doc = list(range(200, 240))
    sched.add(embed_request("a", doc))
    _, _, first, vectors = drive_collecting(sched, worker)
    sched.add(embed_request("b", doc))
    _, _, second, again = drive_collecting(sched, worker)
    assert second[0].new_seqs[0].num_computed_tokens == 32  # two full blocks were cached
    assert again["b"] == vectors["a"] == fake_embedding(doc)


def test_whole_prompt_pooling_is_one_step_and_uncached():
    sched, worker = make_scheduler(40, max_num_batched_tokens=32, max_num_seqs=8,
                                   pooling_whole_prompt=True)
    doc = list(range(300, 330))
    sched.add(Request("gen", list(range(1, 9)), GREEDY))
    plan, _ = step(sched, worker)  # the generation prefills and decodes from now on
    sched.add(embed_request("a", doc))
    sched.add(embed_request("b", doc))
    tokens, reasons, plans, vectors = drive_collecting(sched, worker)
    pooled = [(sid, n) for sid, n in worker.pooled_steps]
    assert [n for _, n in pooled] == [30, 30]  # never split, never from the cache
    assert all(n.num_computed_tokens == 0 for p in plans for n in p.new_seqs if n.pool)
    assert vectors == {"a": fake_embedding(doc), "b": fake_embedding(doc)}
    assert sched.kv.num_free_blocks == 40


def test_admission_of_embedding_requests():
    sched, _ = make_scheduler(40, max_num_batched_tokens=32, max_num_seqs=8,
                              pooling_whole_prompt=True, max_model_len=64)
    with pytest.raises(RequestRejected, match=r"33 tokens .* one step, of at most 32 tokens "
                                              r"\(--max-num-batched-tokens\)"):
        sched.add(embed_request("long", list(range(33))))
    with pytest.raises(RequestRejected, match="one sample and no output tokens"):
        sched.add(Request("n2", [1, 2], SamplingParams(n=2), pooling=PoolingParams()))
    sched.add(embed_request("fits", list(range(32))))  # a pooling prompt may fill the budget
    chunked, _ = make_scheduler(40, max_num_batched_tokens=32, max_num_seqs=8,
                                max_model_len=64)
    chunked.add(embed_request("whole-context", list(range(64))))  # no room to generate needed
    with pytest.raises(RequestRejected, match="input has 65 tokens but max_model_len is 64"):
        chunked.add(embed_request("too-long", list(range(65))))


def test_an_encoder_refuses_generation():
    sched, _ = make_scheduler(40, encoder_only=True, pooling_whole_prompt=True)
    with pytest.raises(RequestRejected, match="encoder: it serves embeddings"):
        sched.add(Request("gen", [1, 2, 3], GREEDY))
    sched.add(embed_request("emb", [1, 2, 3]))


def test_the_service_sends_the_vector_on_and_refeeds_it():
    """Through SchedulerService: the vector goes to the detokenizer with the finish, and a
    restarted detokenizer is re-fed it (the finished request is kept a while)."""
    from pagedserve import transport
    from pagedserve.pipeline import messages
    from pagedserve.pipeline.scheduler.service import SchedulerService
    sched, worker = make_scheduler(64, block_size=4, max_num_seqs=4, report_finished=True)
    to_detok = []
    svc = SchedulerService(sched, send_to_client=lambda c, m: None,
                           send_to_detok=to_detok.append, clock=lambda: 0.0)
    dispatch = transport.Dispatcher("scheduler", svc.handlers())
    dispatch.dispatch(messages.AddRequest(
        request_id="e", prompt_token_ids=[5, 6, 7], sampling=SamplingParams(max_tokens=None),
        arrival_time=0.0, pooling=PoolingParams()), b"client")
    plan = sched.schedule(0.0)
    svc.on_step_result(plan, worker.execute(plan))
    (sample,) = to_detok[-1].samples
    assert (sample.request_id, sample.token_ids, sample.finish_reason) == ("e", [], "stop")
    assert sample.embedding == fake_embedding([5, 6, 7]) and not sched.requests
    svc.refeed_detokenizer()
    assert isinstance(to_detok[-2], messages.DetokOpen)
    assert to_detok[-1].samples[0].embedding == fake_embedding([5, 6, 7])


@pytest.mark.parametrize("mode, whole", [("recompute", False), ("swap", False),
                                         ("recompute", True), ("swap", True)])
def test_embeddings_survive_preemption_in_a_short_pool(mode, whole):
    """A pool too small for everything at once: generations preempt (swap or recompute) each
    other and half-prefilled embedding prompts; every generation still gets its tokens, every
    embedding its vector, and every block comes back."""
    import random
    rng = random.Random(7)
    sched, worker = make_scheduler(16, 16, block_size=4, max_num_batched_tokens=24,
                                   max_num_seqs=6, preemption_mode=mode,
                                   pooling_whole_prompt=whole)
    prompts = {}
    for i in range(14):
        prompt = [rng.randrange(1, 900) for _ in range(rng.randrange(3, 24))]
        if i % 2:
            sched.add(embed_request(f"e{i}", prompt))
        else:
            sched.add(Request(f"g{i}", prompt, SamplingParams(temperature=0.0, max_tokens=24,
                                                              ignore_eos=True)))
        prompts[f"{'e' if i % 2 else 'g'}{i}"] = prompt
    tokens, reasons, plans, vectors = drive_collecting(sched, worker)
    for rid, prompt in prompts.items():
        if rid.startswith("e"):
            assert vectors[rid] == fake_embedding(prompt) and tokens[rid] == {0: []}
        else:
            assert tokens[rid][0] == expected_tokens(prompt, 24, 1000)
    assert sched.stats().num_preemptions > 0
    assert sched.kv.num_free_blocks == 16 and not sched.requests
