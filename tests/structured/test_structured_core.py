"""Structured output's core: spec checks, the packed mask op, matchers rebuilt from token
history, and constrained generation on a tiny random model in one process (EngineCore)."""
import json
import re
import types

import jsonschema
import pytest
import torch

from pagedserve.pipeline import messages
from pagedserve.pipeline.config import EngineConfig
from pagedserve.pipeline.engine_core import EngineCore
from pagedserve.pipeline.ingress.testing import make_tiny_tokenizer
from pagedserve.pipeline.sampling_params import SamplingParams
from pagedserve.pipeline.scheduler.sequence import SequenceStatus
from pagedserve.pipeline.structured.matchers import GrammarBook
from pagedserve.pipeline.structured.spec import StructuredOutputs as S
from pagedserve.workers.sampling.grammar_mask import (apply_bitmask_torch, apply_grammar_masks,
                                                     unpack_bitmask)
from pagedserve.workers.testing import make_tiny_llama

SCHEMA = {"type": "object", "properties": {
    "color": {"enum": ["red", "green", "blue"]},
    "count": {"type": "integer", "minimum": 0, "maximum": 99},
    "ok": {"type": "boolean"},
    "note": {"type": "string", "maxLength": 6},
    "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,4}$"},
             "maxItems": 2}},
    "required": ["color", "count", "ok", "note", "tags"], "additionalProperties": False}
REGEX = r"[a-z]{2,5}-[0-9]{1,3}"
GRAMMAR = 'root ::= "(" num (" + " num)? ")"\nnum ::= [1-9] [0-9]?'


@pytest.mark.parametrize("spec, words", [
    (S.from_json_schema({"type": "objekt"}), "invalid JSON schema"),
    (S(regex="ab(c"), "parenthesis is not closed"),
    (S(grammar="root ::= missing"), 'Rule "missing" is not defined'),
    (S(choice=[]), "non-empty list"),
    (S(regex="a", choice=["a"]), "exactly one"),
])
def test_bad_specs_name_the_problem(spec, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        SamplingParams(structured_outputs=spec).validate()


def test_unpacked_bitmask_is_the_bits():
    words = torch.randint(-2**31, 2**31 - 1, (3, 4), dtype=torch.int32)
    allowed = unpack_bitmask(words, 100)
    for row in range(3):
        for t in range(100):
            assert allowed[row, t].item() == bool((int(words[row, t // 32]) >> (t % 32)) & 1)


def test_the_native_and_torch_mask_ops_agree():
    logits = torch.randn(5, 1000)
    words = torch.randint(-2**31, 2**31 - 1, (3, 32), dtype=torch.int32)
    masks = messages.GrammarMasks([11, 12, 13], 32, words.numpy().tobytes())
    native = apply_grammar_masks(logits, [12, 99, 11, 13, 98], masks)  # CPU fp32: xgrammar's
    expected = logits.clone()
    for row, mask_row in ((0, 1), (2, 0), (3, 2)):
        expected[row] = apply_bitmask_torch(logits[row:row + 1], words[mask_row:mask_row + 1])[0]
    assert torch.equal(native, expected)
    assert torch.equal(apply_grammar_masks(logits.double(), [12, 99, 11, 13, 98], masks),
                       expected.double())  # fp64: the torch op


def test_masks_apply_only_to_their_rows():
    logits = torch.zeros(3, 40)
    words = torch.zeros(1, 2, dtype=torch.int32)
    words[0, 1] = 1 << 3  # token 35 only
    masks = messages.GrammarMasks([7], 2, words.numpy().tobytes())
    out = apply_grammar_masks(logits, [5, 7, 9], masks)
    assert torch.isinf(out[1]).sum() == 39 and out[1, 35] == 0
    assert not torch.isinf(out[0]).any() and not torch.isinf(out[2]).any()
    assert not torch.isinf(logits).any()  # the caller's logits are untouched


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = make_tiny_llama(tmp_path_factory.mktemp("tiny"), seed=5, vocab_size=259)
    make_tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def core(tiny_dir):
    return EngineCore.build(EngineConfig.from_kwargs(
        model=str(tiny_dir), dtype="float32", kv_cache_memory="8MiB", block_size=8,
        max_num_seqs=8, max_num_batched_tokens=64, swap_space=0.0))


def run(core, requests: dict[str, tuple[list[int], SamplingParams]]) -> tuple[dict, list]:
    """Submit and step to the end; {(request id, sample index): text}, and any rejections."""
    rejected = []
    for rid, (prompt, params) in requests.items():
        rejected += core.submit(messages.AddRequest(request_id=rid, prompt_token_ids=prompt,
                                                    sampling=params, arrival_time=0.0))
    text, reasons = {}, {}
    while core.has_unfinished():
        for msg in core.step():
            if isinstance(msg, messages.RequestRejected):
                rejected.append(msg)
                continue
            for d in msg.deltas:
                key = (d.request_id, d.index)
                # the tiny model's EOS is token 2, a byte token: its text is "\x02"
                text[key] = (text.get(key, "") + d.text).removesuffix("\x02")
                if d.finish_reason:
                    reasons[key] = d.finish_reason
    return text, reasons, rejected


def test_every_sample_matches_its_constraint_at_temperature_1(core):
    kinds = {"json": S.from_json_schema(SCHEMA), "regex": S(regex=REGEX),
             "choice": S(choice=["alpha", "beta", "gamma"]), "grammar": S(grammar=GRAMMAR)}
    requests = {f"{kind}{i}": ([40 + i, 50, 60 + i], SamplingParams(
        n=2, temperature=1.0, seed=i, max_tokens=120, structured_outputs=spec))
        for kind, spec in kinds.items() for i in range(4)}
    text, reasons, rejected = run(core, requests)
    assert rejected == []
    assert len(text) == 32 and set(reasons.values()) == {"stop"}
    for (rid, _), out in text.items():
        if rid.startswith("json"):
            jsonschema.validate(json.loads(out), SCHEMA)
        elif rid.startswith("regex"):
            assert re.fullmatch(REGEX, out), out
        elif rid.startswith("choice"):
            assert out in ("alpha", "beta", "gamma")
        else:
            assert re.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?)?\)", out), out
    # the same request without a constraint is not valid JSON: the masks did the work
    free, _, _ = run(core, {"free": ([40, 50, 60], SamplingParams(temperature=1.0, seed=0,
                                                                  max_tokens=30))})
    with pytest.raises(ValueError):
        json.loads(free[("free", 0)])


def test_greedy_constrained_output_is_reproducible(core):
    params = SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=S.from_json_schema(SCHEMA))
    first, _, _ = run(core, {"a": ([1, 2, 3], params)})
    again, _, _ = run(core, {"b": ([1, 2, 3], params)})
    assert first[("a", 0)] == again[("b", 0)]


def test_a_compile_past_the_timeout_is_a_400_and_the_next_request_runs(core):
    compiler = core.service.grammar_gate.compiler
    compiler.timeout_s, saved = -1.0, compiler.timeout_s
    try:
        slow = S(regex="[0-9]{2}x")  # never compiled before: it cannot be ready at once
        _, _, rejected = run(core, {"slow": ([5, 6], SamplingParams(max_tokens=8, structured_outputs=slow))})
    finally:
        compiler.timeout_s = saved
    assert [(r.status, "did not compile within" in r.message) for r in rejected] == [(400, True)]
    text, _, rejected = run(core, {"next": ([5, 6], SamplingParams(max_tokens=8, structured_outputs=S(regex="[0-9]{2}y")))})
    assert rejected == [] and re.fullmatch("[0-9]{2}y", text[("next", 0)])


def _fake_seq(seq_id, request, prompt, outputs, step):
    return types.SimpleNamespace(seq_id=seq_id, request=request, token_ids=prompt + outputs,
                                 num_prompt_tokens=len(prompt), status=SequenceStatus.RUNNING,
                                 last_step=step, num_computed_tokens=len(prompt) + len(outputs),
                                 step_tokens=0)


def test_a_matcher_rebuilt_from_token_history_masks_like_the_live_one(core):
    """What a restarted scheduler (or a recompute) does: a fresh book replays the tokens."""
    spec = S.from_json_schema(SCHEMA)
    gate = core.service.grammar_gate
    gate.compiler.submit(spec).result()
    compiled = gate.compiler.get(spec)
    tokenizer = core.detokenizer.tokenizer
    answer = tokenizer.encode('{"color": "red", "count": 42, "ok": true, "note": "hi", "tags": ["ab"]}')
    live = GrammarBook(259)
    live.add("r", compiled)
    req = types.SimpleNamespace(request_id="r", seqs=[])
    for k in range(len(answer)):
        req.seqs = [_fake_seq(1, req, [9, 9], answer[:k], step=k)]
        masks = live.masks({"r": req}, k, SequenceStatus.RUNNING)
        fresh = GrammarBook(259)
        fresh.add("r", compiled)
        assert fresh.masks({"r": req}, k, SequenceStatus.RUNNING).bitmask == masks.bitmask
        allowed = unpack_bitmask(torch.frombuffer(bytearray(masks.bitmask), dtype=torch.int32)
                                 .view(1, -1), 259)[0]
        assert allowed[answer[k]]  # the valid answer's next token is always allowed


def test_a_thinking_model_is_constrained_after_its_thinking_only(core):
    """--reasoning-parser: no mask while the model thinks; after </think> the schema holds."""
    tokenizer = core.detokenizer.tokenizer
    start, end = tokenizer.encode("<think>"), tokenizer.encode("</think>")
    spec = S(regex="[0-9]+", think_start=start, think_end=end)
    gate = core.service.grammar_gate
    gate.compiler.submit(spec).result()
    book = GrammarBook(259)
    book.add("r", gate.compiler.get(spec), spec)
    req = types.SimpleNamespace(request_id="r", seqs=[])

    def mask_after(text):
        req.seqs = [_fake_seq(len(book.matchers) + 100, req, [9], tokenizer.encode(text), 0)]
        return book.masks({"r": req}, 0, SequenceStatus.RUNNING)

    assert mask_after("<think>any words") is None
    assert mask_after("<thi") is None
    masks = mask_after("<think>hm</think>12")
    allowed = unpack_bitmask(torch.frombuffer(bytearray(masks.bitmask), dtype=torch.int32)
                             .view(1, -1), 259)[0]
    assert allowed[ord("3")] and not allowed[ord("a")]
    assert mask_after("7") is not None  # no thinking block: constrained from the first token


def test_preempted_constrained_sequences_continue_exactly(tiny_dir, core):
    """A pool of 18 blocks forces recompute preemptions: every output is still valid and the
    same as with room to spare (greedy)."""
    from pagedserve.workers.build import build_core
    config = EngineConfig.from_kwargs(model=str(tiny_dir), dtype="float32", kv_cache_memory="8MiB",
                                      block_size=8, max_num_seqs=8, max_num_batched_tokens=64,
                                      swap_space=0.0, preemption_mode="recompute")
    from pagedserve.pipeline.model_resolution import resolve_model
    resolve_model(config)
    worker, _, _ = build_core(config, 0, shared_swap=False)
    small = EngineCore(config, worker, 18, 0, core.detokenizer.tokenizer)
    requests = {f"r{i}": ([30 + i, 40, 50], SamplingParams(
        temperature=0.0, max_tokens=120, structured_outputs=S.from_json_schema(SCHEMA)))
        for i in range(6)}
    tight, _, rejected = run(small, requests)
    assert rejected == [] and small.scheduler.num_preemptions > 0
    roomy, _, _ = run(core, requests)
    assert tight == roomy
    for out in tight.values():
        jsonschema.validate(json.loads(out), SCHEMA)
