"""Prompt logprobs (SamplingParams.prompt_logprobs) through the whole engine in one process,
against transformers' log_softmax of the same prompt: in one chunk, in many (chunked prefill),
with the prefix cache holding the prompt, and for the first token only."""
import numpy as np
import pytest
import torch

from pagedserve.pipeline.ingress.testing import make_tiny_tokenizer
from pagedserve.pipeline.llm import LLM
from pagedserve.pipeline.sampling_params import SamplingParams
from pagedserve.workers import prompt_logprobs as plp
from pagedserve.workers.testing import hf_prompt_logprobs, make_tiny_llama

TOP = 3


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = make_tiny_llama(tmp_path_factory.mktemp("tiny"), seed=5, vocab_size=259)
    make_tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(7)
    return [rng.integers(3, 256, n).tolist() for n in (2, 9, 45, 70)]


@pytest.fixture(scope="module")
def reference(tiny_dir, prompts):
    return [hf_prompt_logprobs(tiny_dir, p) for p in prompts]


def engine(tiny_dir, *, batched_tokens, caching):
    return LLM(in_process=True, model=str(tiny_dir), dtype="float32", kv_cache_memory="8MiB",
               block_size=8, max_num_seqs=4, max_num_batched_tokens=batched_tokens,
               enable_prefix_caching=caching, swap_space=0.0)


def sampling(**params):
    return SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0, prompt_logprobs=TOP,
                          **params)


def run(tiny_dir, prompts, *, batched_tokens, caching, **params):
    llm = engine(tiny_dir, batched_tokens=batched_tokens, caching=caching)
    try:
        return llm.generate(prompts, sampling(**params))
    finally:
        llm.close()


def check_equal_to_transformers(out, prompt, want):
    got = out.prompt_logprobs
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for pos in range(1, len(prompt)):
        entry, row = got[pos], want[pos - 1]
        assert entry[prompt[pos]] == pytest.approx(row[prompt[pos]].item(), abs=1e-3)
        values, ids = row.topk(TOP)
        for token, value in zip(ids.tolist(), values.tolist()):
            assert entry[token] == pytest.approx(value, abs=1e-3)
        assert len(entry) in (TOP, TOP + 1)  # the top-N and the prompt's token


@pytest.mark.parametrize("batched_tokens", [256, 16])  # one chunk; chunks of 16 stitched
def test_prompt_logprobs_equal_transformers(tiny_dir, prompts, reference, batched_tokens):
    outs = run(tiny_dir, prompts, batched_tokens=batched_tokens, caching=False)
    for out, prompt, want in zip(outs, prompts, reference):
        check_equal_to_transformers(out, prompt, want)
        assert len(out.outputs[0].token_ids) == 2


def test_a_cached_prompt_is_computed_again_for_its_logprobs(tiny_dir, prompts, reference):
    """The prompt is in the prefix cache (a plain request reads 64 of its 70 tokens there)
    when a request for its logprobs comes: that one computes every position."""
    prompt = prompts[3]
    llm = engine(tiny_dir, batched_tokens=32, caching=True)
    try:
        def hits():
            return llm.stats()["prefix_cache_hits"]
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
        before = hits()
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
        assert hits() - before == 64
        before = hits()
        (out,) = llm.generate([prompt], sampling())
        check_equal_to_transformers(out, prompt, reference[3])
        assert hits() == before
        (again,) = llm.generate([prompt], sampling())  # its blocks are cached after, as usual
        check_equal_to_transformers(again, prompt, reference[3])
    finally:
        llm.close()


def test_n_samples_carry_one_set_of_prompt_logprobs(tiny_dir, prompts, reference):
    (out,) = run(tiny_dir, [prompts[2]], batched_tokens=16, caching=True, n=2)
    check_equal_to_transformers(out, prompts[2], reference[2])
    assert len(out.outputs) == 2


def test_a_one_token_prompt_has_only_its_none(tiny_dir):
    (out,) = run(tiny_dir, [[42]], batched_tokens=16, caching=True)
    assert out.prompt_logprobs == [None] and len(out.outputs[0].token_ids) == 2


def test_requests_without_prompt_logprobs_get_none(tiny_dir, prompts):
    llm = engine(tiny_dir, batched_tokens=32, caching=True)
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0))
    finally:
        llm.close()
    assert all(out.prompt_logprobs is None for out in outs)


def test_slices_give_the_same_logprobs_as_one_pass(monkeypatch):
    """The LM head runs on at most SLICE_ROWS rows at a time; the result does not depend on it."""
    gen = torch.Generator().manual_seed(0)
    head = torch.randn(50, 8, generator=gen)
    hidden = torch.randn(20, 8, generator=gen)
    items = [(0, [3, 4, 5, 6, 7], 2), (5, [1] * 12, 0), (17, [9, 9, 9], 4)]
    whole = plp.prompt_logprobs(lambda h: h @ head.t(), hidden, items)
    monkeypatch.setattr(plp, "SLICE_ROWS", 4)
    assert plp.prompt_logprobs(lambda h: h @ head.t(), hidden, items) == whole
    want = torch.log_softmax(hidden @ head.t(), dim=1)
    (chosen, tops), (_, none), (_, four) = whole
    assert chosen == pytest.approx(want[[0, 1, 2, 3, 4], [3, 4, 5, 6, 7]].tolist(), abs=1e-6)
    assert [len(t) for t in tops] == [2] * 5 and none == [[]] * 12
    assert [t for t, _ in four[0]] == want[17].topk(4).indices.tolist()


def test_prompt_logprobs_beyond_the_limit_are_refused():
    with pytest.raises(ValueError, match="prompt_logprobs must be between 0 and 20"):
        SamplingParams(prompt_logprobs=21).validate()
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1).validate()


def test_recomputed_prompts_pass_their_logprobs_on_once(tiny_dir, prompts, reference):
    """A cache of 24 blocks for three 70-token prompts growing 40 tokens each: sequences are
    preempted and recompute their prompts, whose logprobs the workers compute again; the
    scheduler passes each position on once, and the numbers stay transformers'."""
    llm = LLM(in_process=True, model=str(tiny_dir), dtype="float32", kv_cache_memory="96KiB",
              block_size=8, max_num_seqs=4, max_num_batched_tokens=32, swap_space=0.0,
              enable_prefix_caching=False)
    try:
        outs = llm.generate([prompts[3]] * 3, SamplingParams(
            max_tokens=40, ignore_eos=True, temperature=0.0, prompt_logprobs=TOP))
        assert llm.stats()["num_preemptions"] > 0
        assert llm.stats()["kv_blocks_total"] == 24
    finally:
        llm.close()
    for out in outs:
        check_equal_to_transformers(out, prompts[3], reference[3])
        assert len(out.outputs[0].token_ids) == 40


def test_a_request_passes_each_prompt_position_on_once():
    from pagedserve.pipeline.messages import PromptLogprobs
    from pagedserve.pipeline.scheduler.sequence import RequestState
    state = RequestState("r", SamplingParams(prompt_logprobs=0), 0.0, 0, None, 6, 4, frozenset())
    assert state.wants_prompt_logprobs
    first = PromptLogprobs(1, [-1.0, -2.0], [[], []])
    assert state.take_prompt_logprobs(first) == first
    assert state.take_prompt_logprobs(first) is None                        # a recompute
    assert state.take_prompt_logprobs(PromptLogprobs(4, [-4.0], [[]])) is None  # a gap
    again = state.take_prompt_logprobs(PromptLogprobs(1, [-1.0, -2.0, -3.0, -4.0, -5.0], [[]] * 5))
    assert again == PromptLogprobs(3, [-3.0, -4.0, -5.0], [[]] * 3)
    assert not state.wants_prompt_logprobs  # all 6 prompt tokens: the prefix cache is readable


def test_the_client_drops_prompt_logprobs_it_already_has():
    """A stream re-fed after a restart repeats prompt logprobs: the client keeps one copy."""
    from pagedserve.pipeline.client import _Stream
    from pagedserve.pipeline.messages import AddRequest, PromptLogprobs, TextDelta
    from pagedserve.pipeline.outputs import CompletionOutput, RequestOutput
    stream = _Stream(AddRequest(request_id="r", prompt_token_ids=[5, 6, 7, 8],
                                sampling=SamplingParams(prompt_logprobs=1), arrival_time=0.0))

    def delta(start, values):
        return TextDelta(request_id="r", index=0, text="", token_ids=[], prompt_logprobs=(
            PromptLogprobs(start, values, [[(9, -0.5)]] * len(values))))
    out = RequestOutput("r", None, [5, 6, 7, 8], [CompletionOutput(index=0)])
    out.apply(stream.accept(delta(1, [-1.0, -2.0])))
    assert stream.accept(delta(1, [-1.0, -2.0])) is None
    tail = stream.accept(delta(1, [-1.0, -2.0, -3.0]))
    assert tail.prompt_logprobs == PromptLogprobs(3, [-3.0], [[(9, -0.5)]])
    out.apply(tail)
    assert out.prompt_logprobs == [None, {9: -0.5, 6: -1.0}, {9: -0.5, 7: -2.0},
                                   {9: -0.5, 8: -3.0}]


@pytest.mark.slow
def test_two_tensor_parallel_ranks_give_transformers_numbers(tiny_dir, prompts, reference):
    """Rank 0 computes them (the LM head is whole on every rank), in chunks of 16, through the
    multi-process group and its client."""
    with LLM(model=str(tiny_dir), dtype="float32", tensor_parallel_size=2, block_size=8,
             kv_cache_memory="8MiB", max_num_batched_tokens=16) as llm:
        outs = llm.generate(prompts, sampling())
    for out, prompt, want in zip(outs, prompts, reference):
        check_equal_to_transformers(out, prompt, want)
