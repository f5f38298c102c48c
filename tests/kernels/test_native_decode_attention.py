"""The native CPU decode kernel (kernels/native) against the torch reference and the naive
per-sequence attention: GQA, block sizes 16 and 32, ragged contexts (some longer than one
partition), shuffled tables padded with -1, head sizes on the vector path and off it, sliding
windows; in every build variant this machine runs, each of which must build the vector body it
stands for."""
import pytest
import torch
from native_variants import PER_VARIANT, expected_vector_lanes
from paged_inputs import (WINDOW_SHAPES, make_kv_cache, naive_attention, rel_error,
                          shuffled_block_tables, window_case)

from pagedserve import kernels
from pagedserve.kernels import native_decode_attention
from pagedserve.kernels.kv_format import to_storage
from pagedserve.kernels.native_decode_attention import paged_decode_attention_native
from pagedserve.kernels.triton_decode_attention import paged_decode_attention_ref

pytestmark = PER_VARIANT

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _inputs(rng, context_lens, num_q_heads, num_kv_heads, block_size, head_dim, dtype):
    num_blocks = sum(-(-n // block_size) for n in context_lens) + 5
    kv_cache = make_kv_cache(rng, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype)
    tables = shuffled_block_tables(rng, context_lens, block_size, num_blocks)
    q = torch.randn(len(context_lens), num_q_heads, head_dim, generator=rng).to(dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    return q, kv_cache[1, 0], kv_cache[1, 1], tables, lens, head_dim ** -0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(9, 3), (4, 4), (8, 1), (10, 1)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128, 48, 40])
def test_matches_reference_and_naive(rng, dtype, num_q_heads, num_kv_heads, block_size,
                                     head_dim):
    # 64/128 with a group of up to 8: the vector path (AVX-512 or AVX2); 48, 40 or a
    # group of 10: the portable path.
    context_lens = [70, 1, 17, block_size * 3, 1100, 5, block_size, 513, 1, 64]
    args = _inputs(rng, context_lens, num_q_heads, num_kv_heads, block_size, head_dim, dtype)
    out = paged_decode_attention_native(*args)
    assert out.shape == args[0].shape and out.dtype == dtype
    assert rel_error(out, paged_decode_attention_ref(*args)) < TOLERANCE[dtype]
    q, k_cache, v_cache, tables, lens, scale = args
    for row, n in enumerate(context_lens):
        expected = naive_attention(q[row:row + 1], k_cache, v_cache, tables[row], n, 1, scale)
        assert rel_error(out[row:row + 1], expected) < TOLERANCE[dtype], row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 20, 300])
@pytest.mark.parametrize("head_dim,num_q_heads,num_kv_heads", WINDOW_SHAPES)
def test_sliding_window_matches_naive_and_skips_dead_blocks(rng, monkeypatch, dtype, head_dim,
                                                            num_q_heads, num_kv_heads, window):
    # head sizes 64/128 with groups up to 8 take the vector body, 256 or a group of 16 the
    # portable one; partitions of 64 tokens count from each row's first visible block, and the
    # blocks wholly before it hold NaN (freed, reused by another sequence)
    monkeypatch.setattr(native_decode_attention, "PART_TOKENS", 64)
    case = window_case(rng, [1, 5, 40, 700, 33], [1] * 5, 16, head_dim, num_q_heads,
                       num_kv_heads, window, dtype)
    out = paged_decode_attention_native(*case.decode_args(), window=window)
    assert out.dtype == dtype
    assert rel_error(out, case.expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("q_dtype,cache_dtype", [
    (torch.float32, torch.float8_e4m3fn), (torch.float32, torch.float8_e5m2),
    (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float8_e4m3fn),
    (torch.bfloat16, torch.float8_e5m2)])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(9, 3, 64), (10, 1, 40),
                                                             (8, 2, 256)])
def test_narrow_caches_match_the_reference(rng, cache_dtype, q_dtype, num_q_heads, num_kv_heads,
                                           head_dim):
    # fp8 (and bf16 under fp32) caches, kernels/kv_format.py: the vector path (64; 256 with
    # AVX-512) and the portable one (40, a group of 10) against the reference, which widens with
    # torch.
    context_lens = [70, 1, 17, 1100, 5, 513]
    q, k_cache, v_cache, tables, lens, scale = _inputs(rng, context_lens, num_q_heads,
                                                       num_kv_heads, 16, head_dim, torch.float32)
    k_cache, v_cache = to_storage(k_cache * 4, cache_dtype), to_storage(v_cache, cache_dtype)
    args = (q.to(q_dtype), k_cache, v_cache, tables, lens, scale)
    out = paged_decode_attention_native(*args)
    assert out.dtype == q_dtype
    assert rel_error(out, paged_decode_attention_ref(*args)) < TOLERANCE[q_dtype]


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("head_dim", [64, 40])
def test_every_fp8_byte_widens_exactly(cache_dtype, head_dim):
    # One key: attention returns its V row, so out is the kernel's widening of each byte. All
    # finite bytes (normals, subnormals, zeros of both signs) must equal torch's conversion.
    codes = torch.arange(256, dtype=torch.uint8).view(cache_dtype)
    codes = codes[codes.float().isfinite()]
    rows = -(-codes.numel() // head_dim)
    flat = torch.zeros(rows * head_dim, dtype=torch.uint8).view(cache_dtype)
    flat[:codes.numel()] = codes
    v_cache = flat.view(rows, 1, 1, head_dim)
    k_cache = torch.zeros_like(v_cache)
    q = torch.randn(rows, 1, head_dim)
    tables = torch.arange(rows, dtype=torch.int32).view(rows, 1)
    lens = torch.ones(rows, dtype=torch.int32)
    out = paged_decode_attention_native(q, k_cache, v_cache, tables, lens, 1.0)
    assert torch.equal(out.flatten()[:codes.numel()], codes.float())


def test_partitions_of_one_long_sequence_merge_exactly(rng, monkeypatch):
    # 8 partitions of 64 tokens for one sequence, against one partition.
    args = _inputs(rng, [500], 9, 3, 16, 64, torch.float32)
    whole = paged_decode_attention_native(*args)
    monkeypatch.setattr(native_decode_attention, "PART_TOKENS", 64)
    split = paged_decode_attention_native(*args)
    assert rel_error(split, whole) < 5e-6     # same math, fp32 rounding of another order
    assert rel_error(split, paged_decode_attention_ref(*args)) < 1e-5


def test_threads_do_not_change_the_result(rng):
    args = _inputs(rng, [300, 40, 700, 2, 129], 9, 3, 16, 64, torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = paged_decode_attention_native(*args)
        torch.set_num_threads(2)
        two = paged_decode_attention_native(*args)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_bad_tables_and_lengths_raise_instead_of_reading_out_of_bounds(rng):
    q, k_cache, v_cache, tables, lens, scale = _inputs(rng, [40, 20], 4, 2, 16, 64,
                                                       torch.float32)
    bad = tables.clone()
    bad[0, 1] = k_cache.shape[0]
    with pytest.raises(ValueError, match="not a valid block id"):
        paged_decode_attention_native(q, k_cache, v_cache, bad, lens, scale)
    bad[0, 1] = -1
    with pytest.raises(ValueError, match="not a valid block id"):
        paged_decode_attention_native(q, k_cache, v_cache, bad, lens, scale)
    too_long = torch.tensor([40, tables.shape[1] * 16 + 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="longer than its block table row"):
        paged_decode_attention_native(q, k_cache, v_cache, tables, too_long, scale)
    with pytest.raises(ValueError, match="context length is < 1"):
        paged_decode_attention_native(q, k_cache, v_cache, tables,
                                      torch.tensor([0, 20], dtype=torch.int32), scale)
    with pytest.raises(ValueError, match="must be torch.int32"):
        paged_decode_attention_native(q, k_cache, v_cache, tables.long(), lens, scale)
    empty = paged_decode_attention_native(q[:0], k_cache, v_cache, tables[:0], lens[:0], scale)
    assert empty.shape == (0, 4, 64)


def test_fp16_falls_back_to_the_torch_path(rng):
    args = _inputs(rng, [30, 7], 4, 2, 16, 64, torch.float16)
    assert not native_decode_attention.supports(args[0], args[1])
    out = kernels.paged_decode_attention(*args)
    assert rel_error(out, paged_decode_attention_ref(*args)) < 2e-2


def test_the_variant_builds_its_vector_body(native_variant):
    # 16 lanes: AVX-512, 8: AVX2 + FMA + F16C, 0: portable; native: what this CPU has
    assert native_decode_attention.vector_lanes() == expected_vector_lanes(native_variant)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_the_batch(rng, dtype):
    # batch invariance: a sequence alone, among others of any length, or repeated as the rows of
    # a multi-token step gives the same bits (greedy speculative decoding relies on it)
    context_lens = [1100, 300, 7, 64, 65, 513, 129]
    q, k_cache, v_cache, tables, lens, scale = _inputs(rng, context_lens, 9, 3, 16, 64, dtype)
    together = paged_decode_attention_native(q, k_cache, v_cache, tables, lens, scale)
    for row in range(len(context_lens)):
        alone = paged_decode_attention_native(q[row:row + 1], k_cache, v_cache,
                                              tables[row:row + 1], lens[row:row + 1], scale)
        assert torch.equal(alone, together[row:row + 1]), row
        repeated = paged_decode_attention_native(q[[row] * 5], k_cache, v_cache,
                                                 tables[[row] * 5], lens[[row] * 5], scale)
        assert all(torch.equal(repeated[i], alone[0]) for i in range(5)), row
