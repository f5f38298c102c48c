"""xgrammar's JSON string classes take ED A0..BF (an encoded UTF-16 surrogate, never valid
UTF-8); the Utf8Guard takes those tokens out of the mask, and nothing else."""
import json

import torch
import xgrammar as xgr

from pagedserve.pipeline.ingress.testing import make_tiny_tokenizer
from pagedserve.pipeline.ingress.tokens import _BYTE_OF_CHAR
from pagedserve.pipeline.structured.utf8_guard import Utf8Guard

VOCAB = 259


def allowed(row, token: int) -> bool:
    return bool((int(row[token // 32]) >> (token % 32)) & 1)


def test_the_guard_bans_surrogates_after_ed_and_nothing_valid():
    tokenizer = make_tiny_tokenizer()  # one token per byte: token of byte b
    byte_token = {_BYTE_OF_CHAR[t]: i for t, i in tokenizer.get_vocab().items()
                  if len(t) == 1 and t in _BYTE_OF_CHAR}
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB)
    compiled = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False).compile_json_schema(
        json.dumps({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}))
    matcher = xgr.GrammarMatcher(compiled)
    for b in b'{"a": "\xed':
        assert matcher.accept_token(byte_token[b])
    words = (VOCAB + 31) // 32
    bitmask = torch.full((1, words), -1, dtype=torch.int32)
    matcher.fill_next_token_bitmask(bitmask, 0)
    assert allowed(bitmask[0], byte_token[0xA0])   # xgrammar alone lets a surrogate through
    before = bitmask.clone()
    guard = Utf8Guard(info.decoded_vocab, words)
    guard.apply(bitmask[0], byte_token[0xED])
    for b in range(256):
        expected = allowed(before[0], byte_token[b]) and b not in range(0xA0, 0xC0)
        assert allowed(bitmask[0], byte_token[b]) == expected, hex(b)
    assert [b for b in range(256) if allowed(bitmask[0], byte_token[b])] == list(range(0x80, 0xA0))
    # not after ED: only tokens that hold ED A0..BF themselves (none in a one-byte vocabulary)
    guard.apply(before[0], byte_token[ord("x")])
    assert allowed(before[0], byte_token[0xA0])


def test_multibyte_tokens_holding_a_surrogate_are_always_banned():
    vocab = [b"a", b"\xed\xa0\x80", b"x\xed\xbf", b"\xed\x9f\xbf", b"\xed", b"\xa5z"] + [b""] * 58
    guard = Utf8Guard(vocab, 2)
    row = torch.full((2,), -1, dtype=torch.int32)
    guard.apply(row, 0)
    assert [t for t in range(6) if allowed(row, t)] == [0, 3, 4, 5]
    assert allowed(row, 63)  # bit 31 of a word survives the int32 sign
    row = torch.full((2,), -1, dtype=torch.int32)
    guard.apply(row, 4)  # after a trailing lead ED: no A0..BF first byte either
    assert [t for t in range(6) if allowed(row, t)] == [0, 3, 4]
