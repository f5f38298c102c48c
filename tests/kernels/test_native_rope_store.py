"""kernels/native_rope_store.py (kernels/native/rope_store.c) against the torch path it
replaces: RotaryEmbedding.apply on q and k, then kernels.store_kv, for fp32 and bf16 models and
caches, skipped slots, threads, strided qkv rows, and bad input that must change nothing; in every
build variant this machine runs."""
from __future__ import annotations

import pytest
import torch
from native_variants import PER_VARIANT

from pagedserve.kernels import native_rope_store
from pagedserve.kernels.triton_store_kv import store_kv_ref
from pagedserve.workers.models.rotary import RotaryEmbedding

pytestmark = PER_VARIANT


def _inputs(rng, tokens, nq, nkv, d, num_blocks=12, block_size=16, cache_dtype=torch.float32,
            row_pad=0, dtype=torch.float32):
    width = (nq + 2 * nkv) * d
    qkv = torch.randn(tokens, width + row_pad, generator=rng).to(dtype)[:, :width]
    rope = RotaryEmbedding(d, 4096, 10000.0, None, dtype, "cpu")
    positions = torch.randint(0, 4096, (tokens,), generator=rng)
    cos, sin = rope.cos_sin(positions)
    slots = torch.randperm(num_blocks * block_size, generator=rng)[:tokens]
    cache = torch.randn(2, num_blocks, block_size, nkv, d, generator=rng).to(cache_dtype)
    return qkv, cos, sin, slots, cache


def _torch_path(qkv, cos, sin, cache, slots, nq, nkv, d):
    view = qkv.reshape(qkv.shape[0], nq + 2 * nkv, d)
    qk = RotaryEmbedding.apply(view[:, :nq + nkv], cos, sin)
    store_kv_ref(qk[:, nq:], view[:, nq + nkv:], cache[0], cache[1], slots)
    return qk[:, :nq]


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,nq,nkv,d", [(1, 9, 3, 64), (64, 9, 3, 64), (37, 4, 4, 128),
                                             (300, 8, 1, 40), (5, 2, 2, 2), (9, 14, 2, 256),
                                             (3, 16, 1, 256)])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_rope_then_store_kv(rng, cache_dtype, tokens, nq, nkv, d, threads):
    qkv, cos, sin, slots, cache = _inputs(rng, tokens, nq, nkv, d, num_blocks=24,
                                          cache_dtype=cache_dtype, row_pad=3)
    slots[::5] = -1                           # tokens whose K/V this rank does not store
    expected_cache = cache.clone()
    expected_q = _torch_path(qkv, cos, sin, expected_cache, slots, nq, nkv, d)
    q = native_rope_store.rope_store(qkv, cos, sin, cache[0], cache[1], slots, nq, nkv, threads)
    assert q.shape == (tokens, nq, d) and q.dtype == torch.float32 and q.is_contiguous()
    torch.testing.assert_close(q, expected_q, rtol=1e-6, atol=1e-6)
    if cache_dtype == torch.float32:
        torch.testing.assert_close(cache, expected_cache, rtol=1e-6, atol=1e-6)
    else:   # a rounding difference in the fp32 rotation may flip the last bf16 bit
        assert (cache.float() - expected_cache.float()).abs().max() <= 2 ** -7 * (
            expected_cache.float().abs().max())
        assert (cache != expected_cache).float().mean() < 0.01


@pytest.mark.parametrize("tokens,nq,nkv,d", [(1, 9, 3, 64), (64, 9, 3, 64), (300, 8, 1, 40),
                                             (9, 14, 2, 256)])
def test_bf16_model_rounds_the_exact_rotation_once(rng, tokens, nq, nkv, d):
    # bf16 products are exact in fp32, so rotating in fp32 and rounding once gives the exact
    # rotation's rounding; torch's bf16 ops round twice (mul, then addcmul): an ulp off at times
    # (a bf16 model keeps a bf16 cache: an fp32 cache under bf16 queries is refused at start)
    qkv, cos, sin, slots, cache = _inputs(rng, tokens, nq, nkv, d, num_blocks=24,
                                          cache_dtype=torch.bfloat16, row_pad=3,
                                          dtype=torch.bfloat16)
    slots[::5] = -1
    exact_cache = cache.double()
    exact_q = _torch_path(qkv.double(), cos.double(), sin.double(), exact_cache, slots, nq,
                          nkv, d)
    torch_cache = cache.clone()
    torch_q = _torch_path(qkv, cos, sin, torch_cache, slots, nq, nkv, d)
    q = native_rope_store.rope_store(qkv, cos, sin, cache[0], cache[1], slots, nq, nkv)
    assert q.shape == (tokens, nq, d) and q.dtype == torch.bfloat16
    # fp32 sums of two exact products, rounded to bf16: a double rounding can flip a tie
    assert float((q != exact_q.to(torch.bfloat16)).float().mean()) < 0.001
    assert float((cache != exact_cache.to(torch.bfloat16)).float().mean()) < 0.001
    for out, reference in ((q, torch_q), (cache, torch_cache)):
        torch.testing.assert_close(out.float(), reference.float(), rtol=2 ** -7, atol=2 ** -7)


def test_bf16_rounds_to_nearest_even_and_keeps_nan_and_inf():
    d = 4
    values = torch.tensor([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -2.5, float("inf"), float("nan"),
                           3.0e38, 1e-40, -0.0])
    tokens = values.numel()
    qkv = torch.zeros(tokens, 3 * d)
    qkv[:, 2 * d:] = values[:, None]          # V is stored as is (no rotation)
    cos = torch.ones(tokens, d // 2)
    sin = torch.zeros(tokens, d // 2)
    cache = torch.zeros(2, 1, 16, 1, d, dtype=torch.bfloat16)
    native_rope_store.rope_store(qkv, cos, sin, cache[0], cache[1],
                                 torch.arange(tokens), 1, 1)
    stored = cache[1, 0, :tokens, 0, 0]
    expected = values.to(torch.bfloat16)
    assert torch.equal(stored.view(torch.int16)[~values.isnan()],
                       expected.view(torch.int16)[~values.isnan()])
    assert stored[values.isnan()].isnan().all()


def test_bad_input_raises_and_writes_nothing(rng):
    qkv, cos, sin, slots, cache = _inputs(rng, 8, 9, 3, 64)
    before = cache.clone()
    bad = slots.clone()
    bad[-1] = cache.shape[1] * cache.shape[2]         # one past the last slot
    with pytest.raises(ValueError, match="past the cache"):
        native_rope_store.rope_store(qkv, cos, sin, cache[0], cache[1], bad, 9, 3)
    assert torch.equal(cache, before)
    with pytest.raises(ValueError, match="does not hold"):
        native_rope_store.rope_store(qkv, cos, sin, cache[0], cache[1], slots, 8, 3)
    with pytest.raises(ValueError, match="slot_mapping"):
        native_rope_store.rope_store(qkv, cos, sin, cache[0], cache[1], slots[:4], 9, 3)
    with pytest.raises(ValueError, match="int64"):
        native_rope_store.rope_store(qkv, cos, sin, cache[0], cache[1], slots.int(), 9, 3)
    with pytest.raises(ValueError, match="cos/sin"):
        native_rope_store.rope_store(qkv, cos[:4], sin[:4], cache[0], cache[1], slots, 9, 3)
    with pytest.raises(ValueError, match="fp32"):
        native_rope_store.rope_store(qkv.double(), cos, sin, cache[0], cache[1], slots, 9, 3)
    with pytest.raises(ValueError, match="cos/sin must be torch.bfloat16"):   # fp32 tables
        native_rope_store.rope_store(qkv.bfloat16(), cos, sin, cache[0], cache[1], slots, 9, 3)
    with pytest.raises(ValueError, match="v_cache"):
        native_rope_store.rope_store(qkv, cos, sin, cache[0], cache[1, :6], slots, 9, 3)
    assert torch.equal(cache, before)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_a_prepared_call_serves_every_layer_with_the_same_bits(rng, cache_dtype):
    """The step's call prepared by the first layer (kept in `prepared`) gives each layer the bits
    of an unprepared call; other slots or another qkv shape are prepared again."""
    nq, nkv, d, tokens = 9, 3, 64, 7
    _, cos, sin, slots, _ = _inputs(rng, tokens, nq, nkv, d, num_blocks=24)
    prepared: dict = {}
    for layer in range(3):
        qkv, _, _, _, cache = _inputs(rng, tokens, nq, nkv, d, num_blocks=24,
                                      cache_dtype=cache_dtype, row_pad=5)
        plain = cache.clone()
        q = native_rope_store.rope_store(qkv, cos, sin, cache[0], cache[1], slots, nq, nkv,
                                         prepared=prepared)
        want = native_rope_store.rope_store(qkv, cos, sin, plain[0], plain[1], slots, nq, nkv)
        assert torch.equal(q, want) and torch.equal(cache, plain), layer
    assert len(prepared) == 1
    other = slots.clone()
    native_rope_store.rope_store(qkv, cos, sin, cache[0], cache[1], other, nq, nkv,
                                 prepared=prepared)
    assert len(prepared) == 2
    [call] = [entry[3] for entry in prepared.values() if entry[2] is slots]
    with pytest.raises(ValueError, match="do not match the call's preparation"):
        call(qkv[:, :-d], cache[0], cache[1])
