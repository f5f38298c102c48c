"""IncrementalDetokenizer: streamed text must equal a one-shot decode, whatever the chunking."""
from __future__ import annotations

import functools
import json

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pagedserve.pipeline.detokenizer.incremental import MAX_HELD_INVALID, IncrementalDetokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello, world!",
    "你好，世界。今天天气很好，我们去公园散步吧。",
    "こんにちは世界、カタカナとひらがな。",
    "Привет, мир! Съешь же ещё этих мягких французских булок.",
    "مرحبا بالعالم",
    "Emoji: 😀🎉👍🏽 🇫🇷 👨‍👩‍👧 ❤️ café naïve Ünïcödé",
]
# Characters from several scripts, many outside the small vocabularies below, so they are split
# into byte tokens (2-4 per character).
ALPHABET = ("abcdefghijklmnopqrstuvwxyz ABC .,!?\n\t  "
            "你好世界天气数据库中文字符こんにちはカタカナПриветмирёйمرحبا"
            "😀🎉👍🏽🇫🇷👨‍👩‍👧❤️🦀𝄞éüßñ")


@functools.lru_cache(maxsize=None)
def byte_level_tokenizer():
    """GPT-2 style byte-level BPE (like SmolLM2): decode is lossy UTF-8 of the tokens' bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=["<eos>", "<|im_start|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


@functools.lru_cache(maxsize=None)
def sentencepiece_tokenizer():
    """Llama-2 style: "▁" for spaces, byte fallback for unknown characters, and a decoder that
    strips the leading space of the first token, so a token's text depends on what precedes it."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  limit_alphabet=60)
    tok.train_from_iterator(CORPUS * 4, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                   bos_token="<s>", eos_token="</s>")


def stream(tokenizer, prompt_ids, output_ids, chunk_sizes, **kwargs) -> list[str]:
    """Feeds output_ids in chunks of the given sizes (cycled); returns every piece emitted."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, **kwargs)
    pieces, pos, i = [], 0, 0
    while pos < len(output_ids):
        size = chunk_sizes[i % len(chunk_sizes)] if chunk_sizes else 1
        pieces.append(detok.add(output_ids[pos:pos + size]))
        pos, i = pos + size, i + 1
    pieces.append(detok.flush())
    return pieces


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


chunkings = st.lists(st.integers(1, 4), min_size=1, max_size=5)
texts = st.text(alphabet=ALPHABET, min_size=1, max_size=40) | st.sampled_from(CORPUS)
fast = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- byte-level BPE ---------------------------------------------------------------------------

def test_emoji_and_cjk_split_across_byte_tokens_byte_level():
    tok = byte_level_tokenizer()
    text = "Hi 😀 你好 🦀 数据库!"
    ids = encode(tok, text)
    pieces = stream(tok, [], ids, [1])
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True) == text
    assert len(ids) > len(text.split()) + 6, "the test needs characters split into byte tokens"
    assert not any("\ufffd" in p for p in pieces), "a partial character was emitted early"
    assert pieces[-1] == "", "nothing should be held back once the last character completed"


@fast
@given(text=texts, data=st.data(), chunk_sizes=chunkings)
def test_stream_equals_decode_of_output_ids_byte_level(text, data, chunk_sizes):
    tok = byte_level_tokenizer()
    ids = encode(tok, text)
    split = data.draw(st.integers(0, len(ids)), label="prompt length")
    prompt, output = ids[:split], ids[split:]
    pieces = stream(tok, prompt, output, chunk_sizes)
    expected = tok.decode(output, skip_special_tokens=True)
    assert "".join(pieces) == expected
    if not expected.endswith("\ufffd"):
        assert pieces[-1] == "", "text was held back after its last character completed"


@fast
@given(prompt=st.lists(st.integers(0, 419), max_size=8),
       output=st.lists(st.integers(0, 419), max_size=60), chunk_sizes=chunkings,
       skip=st.booleans(), via_decode=st.booleans())
def test_stream_equals_decode_for_arbitrary_ids_byte_level(prompt, output, chunk_sizes, skip,
                                                           via_decode):
    """Random ids make invalid UTF-8 and special tokens anywhere; still exact."""
    tok = byte_level_tokenizer()
    # The wrapper has no Rust backend, so the detokenizer goes through tokenizer.decode.
    used = CountingTokenizer(tok) if via_decode else tok
    pieces = stream(used, prompt, output, chunk_sizes, skip_special_tokens=skip)
    assert "".join(pieces) == tok.decode(output, skip_special_tokens=skip)


def test_special_tokens_skipped_or_kept():
    tok = byte_level_tokenizer()
    eos, im_start = tok.convert_tokens_to_ids(["<eos>", "<|im_start|>"])
    output = encode(tok, "Hello") + [im_start] + encode(tok, " 你好") + [eos]
    assert "".join(stream(tok, [], output, [1])) == "Hello 你好"
    kept = "".join(stream(tok, [], output, [1], skip_special_tokens=False))
    assert kept == tok.decode(output, skip_special_tokens=False) == "Hello<|im_start|> 你好<eos>"


class CountingTokenizer:
    """Records how many ids each decode call was given."""

    def __init__(self, inner):
        self.inner, self.sizes = inner, []
        self.all_special_ids = inner.all_special_ids
        self.added_tokens_decoder = inner.added_tokens_decoder

    def decode(self, ids, **kwargs):
        self.sizes.append(len(ids))
        return self.inner.decode(ids, **kwargs)


@pytest.mark.parametrize("kind", ["text", "eos_run", "invalid_utf8"])
def test_window_stays_bounded(kind):
    tok = byte_level_tokenizer()
    eos = tok.eos_token_id
    # GPT-2's byte-to-symbol map: bytes 0x00-0x20 become U+0100.., then 0x7F U+0121, 0x80 U+0122.
    lone_continuation = tok.convert_tokens_to_ids("\u0122")
    assert tok.decode([lone_continuation]) == "\ufffd"
    if kind == "text":
        output = encode(tok, " ".join(CORPUS) * 8)
    elif kind == "eos_run":  # ignore_eos: a model that keeps sampling EOS after a partial char
        crab = encode(tok, "🦀")
        assert len(crab) > 1
        output = crab[:1] + [eos] * 400 + crab[1:]
    else:
        output = [lone_continuation] * 400 + encode(tok, "🦀")
    counting = CountingTokenizer(tok)
    pieces = stream(counting, encode(tok, "prompt"), output, [1])
    assert "".join(pieces) == tok.decode(output, skip_special_tokens=True)
    assert len(output) >= 400
    # The window holds at most a few searches' worth of held tokens, not the 400 we fed.
    assert max(counting.sizes) <= 3 * MAX_HELD_INVALID, "decode window grew with the output"


# --- SentencePiece style (leading-space handling, byte fallback) ------------------------------

def test_leading_space_matches_decode_of_full_ids():
    tok = sentencepiece_tokenizer()
    prompt, full = encode(tok, "Hello"), encode(tok, "Hello world")
    output = full[len(prompt):]
    assert full[:len(prompt)] == prompt
    # On its own, this tokenizer drops the first token's leading space.
    assert tok.decode(output, skip_special_tokens=True) == "world"
    assert "".join(stream(tok, prompt, output, [1])) == " world"


@fast
@given(text=texts, data=st.data(), chunk_sizes=chunkings)
def test_stream_equals_full_decode_difference_sentencepiece(text, data, chunk_sizes):
    tok = sentencepiece_tokenizer()
    ids = encode(tok, text)
    split = data.draw(st.integers(0, len(ids)), label="prompt length")
    prompt, output = ids[:split], ids[split:]
    prompt_text = tok.decode(prompt, skip_special_tokens=True)
    full_text = tok.decode(ids, skip_special_tokens=True)
    assume(full_text.startswith(prompt_text))  # the prompt does not end inside a character
    assert "".join(stream(tok, prompt, output, chunk_sizes)) == full_text[len(prompt_text):]


def test_cjk_and_emoji_byte_fallback_sentencepiece():
    tok = sentencepiece_tokenizer()
    text = "数据库 🦀 ok 𝄞"
    ids = encode(tok, text)
    assert any(t.startswith("<0x") for t in tok.convert_ids_to_tokens(ids))
    pieces = stream(tok, [], ids, [1])
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True) == text
    assert not any("\ufffd" in p for p in pieces)


# --- the real tokenizer (SmolLM2; first use converts the model, hence slow) -------------------

@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from pagedserve.workers.loader import TEST_MODEL, resolve_model
    from pagedserve.pipeline.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(TEST_MODEL))


@pytest.mark.slow
@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(text=texts, data=st.data(), chunk_sizes=chunkings)
def test_real_tokenizer_stream_equals_decode(smollm2_tokenizer, text, data, chunk_sizes):
    tok = smollm2_tokenizer
    ids = encode(tok, text)
    split = data.draw(st.integers(0, len(ids)), label="prompt length")
    output = ids[split:]
    expected = tok.decode(output, skip_special_tokens=True)
    assert "".join(stream(tok, ids[:split], output, chunk_sizes)) == expected


@pytest.mark.slow
def test_real_tokenizer_chat_output(smollm2_tokenizer):
    tok = smollm2_tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Say hi in Chinese"}],
                                     add_generation_prompt=True, tokenize=True)
    if isinstance(prompt, dict) or hasattr(prompt, "input_ids"):
        prompt = prompt["input_ids"]
    output = encode(tok, "你好！👋 Nǐ hǎo means hello.") + [tok.eos_token_id]
    for skip in (True, False):
        pieces = stream(tok, prompt, output, [1], skip_special_tokens=skip)
        assert "".join(pieces) == tok.decode(output, skip_special_tokens=skip)
        assert not any("\ufffd" in p for p in pieces)
