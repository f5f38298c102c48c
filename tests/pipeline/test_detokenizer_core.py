"""DetokenizerCore: many requests, stop strings ending requests, resume after a restart."""
from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.pipeline.detokenizer.core import DetokenizerCore
from pagedserve.pipeline.sampling_params import SamplingParams

TEXT = "The quick brown fox says 你好 🦀 and then stops. Done!"


@functools.lru_cache(maxsize=None)
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=330, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["The quick brown fox jumps over the lazy dog. Done!"] * 8, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def ids_of(text):
    return tokenizer().encode(text, add_special_tokens=False)


def run(params, output_ids, *, prompt="Say:", per_feed=1, finish_reason="length",
        text_offset=0, token_offset=0):
    core = DetokenizerCore(tokenizer())
    core.open("r", ids_of(prompt), params, text_offset=text_offset, token_offset=token_offset)
    deltas = []
    for i in range(0, len(output_ids), per_feed):
        last = i + per_feed >= len(output_ids)
        d = core.feed("r", output_ids[i:i + per_feed], last, finish_reason if last else None)
        if d is not None:
            deltas.append(d)
    return core, deltas


def test_stop_string_spanning_two_tokens_ends_the_request():
    ids = ids_of(TEXT)
    tok = tokenizer()
    pieces = [tok.decode([i]) for i in ids]
    assert "ck" in pieces[1] and "bro" in pieces[2], pieces  # " quick" | " brown"
    core, deltas = run(SamplingParams(stop=["ck bro"]), ids)
    assert "".join(d.text for d in deltas) == "The qui"
    last = deltas[-1]
    assert (last.finished, last.finish_reason, last.stop_matched) == (True, "stop", "ck bro")
    assert len(deltas) == 3, "tokens after the stop must be ignored"
    assert all(not d.finished for d in deltas[:-1])
    assert core.feed("r", ids_of(" more"), False, None) is None


def test_ids_after_the_one_completing_a_stop_are_dropped():
    ids = ids_of(TEXT)
    _, deltas = run(SamplingParams(stop=["ck bro"]), ids, per_feed=len(ids))
    assert len(deltas) == 1
    assert (deltas[0].text, deltas[0].stop_matched) == ("The qui", "ck bro")
    assert deltas[0].token_ids == ids[:3]          # "The", " quick", " brown"
    assert deltas[0].num_output_tokens == 3


def test_include_stop_str_and_multiple_stops():
    params = SamplingParams(stop=["stops", "fox"], include_stop_str_in_output=True)
    _, deltas = run(params, ids_of(TEXT), per_feed=3)
    assert "".join(d.text for d in deltas) == "The quick brown fox"
    assert deltas[-1].stop_matched == "fox"


def test_no_stop_finishes_with_scheduler_reason_and_flushes_held_text():
    # "Done" could start the stop "Done?": held back until the request ends.
    _, deltas = run(SamplingParams(stop=["Done?"]), ids_of(TEXT), finish_reason="length")
    assert "".join(d.text for d in deltas) == TEXT
    assert not deltas[-2].text.endswith("Done")
    assert (deltas[-1].finished, deltas[-1].finish_reason, deltas[-1].stop_matched) == (
        True, "length", None)
    assert deltas[-1].num_output_tokens == len(ids_of(TEXT))


def test_min_tokens_lets_early_stop_strings_through():
    ids = ids_of("a. b. c.")
    _, deltas = run(SamplingParams(stop=["."], min_tokens=3), ids)
    text = "".join(d.text for d in deltas)
    assert text == "a. b", text
    assert deltas[-1].stop_matched == "."


def test_emoji_cjk_stream_equals_decode_of_full_ids():
    ids = ids_of("数据库 🦀🦀 你好 👨‍👩‍👧 ok") + [tokenizer().eos_token_id]
    _, deltas = run(SamplingParams(), ids, finish_reason="stop")
    assert "".join(d.text for d in deltas) == tokenizer().decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in d.text for d in deltas)
    assert [t for d in deltas for t in d.token_ids] == ids
    _, deltas = run(SamplingParams(skip_special_tokens=False), ids, finish_reason="stop")
    assert "".join(d.text for d in deltas).endswith("ok<eos>")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cut=st.integers(0, 60), per_feed=st.integers(1, 5), stop=st.sampled_from(
    [[], ["stops"], ["🦀 and"], ["!"]]))
def test_resume_with_text_offset_emits_only_the_rest(cut, per_feed, stop):
    params = SamplingParams(stop=stop)
    ids = ids_of(TEXT)
    _, deltas = run(params, ids)
    full_text = "".join(d.text for d in deltas)
    cut = min(cut, len(deltas))
    had_text = "".join(d.text for d in deltas[:cut])
    had_ids = sum(len(d.token_ids) for d in deltas[:cut])
    # A restarted detokenizer is re-fed every output id; the client already holds `had_text`.
    _, resumed = run(params, ids, per_feed=per_feed, text_offset=len(had_text),
                     token_offset=had_ids)
    assert had_text + "".join(d.text for d in resumed) == full_text
    sent_ids = [t for d in deltas for t in d.token_ids]
    assert sent_ids[:had_ids] + [t for d in resumed for t in d.token_ids] == sent_ids
    assert resumed[-1].finish_reason == deltas[-1].finish_reason
    assert resumed[-1].stop_matched == deltas[-1].stop_matched


def test_requests_are_independent():
    core = DetokenizerCore(tokenizer())
    core.open("a", [], SamplingParams(stop=["fox"]))
    core.open("b", ids_of("x"), SamplingParams())
    a_ids, b_ids = ids_of(TEXT), ids_of("你好 🦀!")
    texts = {"a": "", "b": ""}
    for i in range(max(len(a_ids), len(b_ids))):
        for rid, ids in (("a", a_ids), ("b", b_ids)):
            if i < len(ids):
                d = core.feed(rid, ids[i:i + 1], i == len(ids) - 1, "length")
                if d is not None:
                    texts[rid] += d.text
    assert texts == {"a": "The quick brown ", "b": "你好 🦀!"}
    assert len(core) == 2
    core.close("a")
    core.close("a")
    assert "a" not in core and "b" in core
    assert core.feed("a", [1], False, None) is None


def test_open_twice_and_bad_offsets_are_errors():
    core = DetokenizerCore(tokenizer())
    core.open("r", [], SamplingParams())
    with pytest.raises(ValueError, match="already open"):
        core.open("r", [], SamplingParams())
    with pytest.raises(ValueError, match="text_offset=-1"):
        core.open("s", [], SamplingParams(), text_offset=-1)
