"""A step's plain decodes go scheduler -> detokenizer as TokenBatch columns; the detokenizer
turns them into the same text deltas as one SampleTokens each, and dedupes re-fed ones."""
from __future__ import annotations

import msgpack
import msgspec

from pagedserve.pipeline import messages
from pagedserve.pipeline.detokenizer.service import DetokenizerService
from pagedserve.pipeline.sampling_params import SamplingParams
from pagedserve.pipeline.scheduler.service import SchedulerService
from sched_fakes import make_scheduler
from test_detokenizer_core import ids_of, tokenizer

VOCAB = 300  # the test tokenizer's ids


def wire(msg):
    """Through msgpack and back, as the PUSH/PULL socket carries it."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=type(msg))


def group():
    sched, worker = make_scheduler(64, block_size=4, vocab=VOCAB)
    to_detok, to_client = [], []
    service = SchedulerService(sched, send_to_client=lambda c, m: None,
                               send_to_detok=to_detok.append, clock=lambda: 0.0)
    detok = DetokenizerService(tokenizer(), lambda c, m: to_client.append((c, m)),
                               lambda m: None)
    return sched, worker, service, detok, to_detok, to_client


def pump(detok, to_detok):
    for msg in to_detok:
        msg = wire(msg)
        if isinstance(msg, messages.DetokOpen):
            detok.open(msg)
        else:
            detok.on_tokens(msg)
    to_detok.clear()


def test_columns_carry_a_streams_tokens_and_offsets():
    sched, worker, service, detok, to_detok, to_client = group()
    for rid, client in (("a", b"c1"), ("b", b"c2")):
        service.on_add(client, messages.AddRequest(
            request_id=rid, prompt_token_ids=ids_of("The quick"), arrival_time=0.0,
            sampling=SamplingParams(max_tokens=9, ignore_eos=True)))
    batches = []
    while sched.has_unfinished():
        plan = sched.schedule(0.0)
        service.on_step_result(plan, worker.execute(plan))
        batches += [m for m in to_detok if isinstance(m, messages.TokenBatch)]
        pump(detok, to_detok)
    columnar = [b for b in batches if b.request_ids]
    assert columnar and all(b.samples == [] for b in columnar[:-1])
    raw = msgpack.unpackb(msgspec.msgpack.encode(columnar[0]))
    assert raw["request_ids"] == ["a", "b"] and len(raw["token_ids"]) == 2
    assert raw["offsets"] == [columnar[0].offsets[0]] * 2
    for rid, client in (("a", b"c1"), ("b", b"c2")):
        deltas = [d for c, m in to_client for d in m.deltas if c == client]
        ids = [t for d in deltas for t in d.token_ids]
        assert len(ids) == 9 and [d.token_offset for d in deltas] == \
            [sum(len(e.token_ids) for e in deltas[:i]) for i in range(len(deltas))]
        assert "".join(d.text for d in deltas) == tokenizer().decode(ids)
        assert deltas[-1].finish_reason == "length"
        # the columns' offsets are output positions (the prompt step's token is output 0)
        assert [b.offsets[b.request_ids.index(rid)] for b in columnar] == \
            list(range(len(columnar)))
    assert detok.owners == {}


def test_refed_and_unknown_columns_are_dropped():
    sched, worker, service, detok, to_detok, to_client = group()
    service.on_add(b"c1", messages.AddRequest(
        request_id="a", prompt_token_ids=ids_of("The"), arrival_time=0.0,
        sampling=SamplingParams(max_tokens=20, ignore_eos=True)))
    for _ in range(3):
        plan = sched.schedule(0.0)
        service.on_step_result(plan, worker.execute(plan))
    last = [m for m in to_detok if isinstance(m, messages.TokenBatch)][-1]
    assert last.request_ids == ["a"]
    pump(detok, to_detok)
    seen = sum(len(d.token_ids) for _, m in to_client for d in m.deltas)
    assert seen == 3
    # the same columns again (a re-feed), and a request the detokenizer never opened
    detok.on_tokens(wire(last))
    detok.on_tokens(messages.TokenBatch(9, [], ["zz"], [0], [5], [0]))
    assert sum(len(d.token_ids) for _, m in to_client for d in m.deltas) == seen
