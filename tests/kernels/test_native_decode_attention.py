"""The native CPU decode kernel (kernels/native) against the torch reference and the naive
per-sequence attention: GQA, block sizes 16 and 32, ragged contexts (some longer than one
partition), shuffled tables padded with -1, head sizes on the vector path and off it, and the
AVX2 and portable builds of an AVX-512 CPU."""
import os
import subprocess
import sys

import pytest
import torch
from paged_inputs import make_kv_cache, naive_attention, rel_error, shuffled_block_tables

from pagedserve import kernels
from pagedserve.kernels import native, native_decode_attention
from pagedserve.kernels.kv_format import to_storage
from pagedserve.kernels.native_decode_attention import paged_decode_attention_native
from pagedserve.kernels.paged_decode_attention import paged_decode_attention_ref

FEATURE = native_decode_attention.FEATURE
pytestmark = pytest.mark.skipif(native.library(FEATURE) is None,
                                reason=f"no native kernels: {native.unavailable_reason(FEATURE)}")

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


@pytest.mark.parametrize("q_dtype,cache_dtype", [
    (torch.float32, torch.float8_e4m3fn), (torch.float32, torch.float8_e5m2),
    (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float8_e4m3fn),
    (torch.bfloat16, torch.float8_e5m2)])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(9, 3, 64), (10, 1, 40)])
def test_narrow_caches_match_the_reference(rng, cache_dtype, q_dtype, num_q_heads, num_kv_heads,
                                           head_dim):
    # fp8 (and bf16 under fp32) caches, kernels/kv_format.py: the vector path (64) and the
    # portable one (40, a group of 10) against the reference, which widens with torch.
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


def test_builds_into_a_fresh_cache_and_reports_a_missing_compiler(tmp_path):
    code = ("from pagedserve.kernels import native\n"
            "lib = native.library('decode_attention')\n"
            "print('built' if lib is not None else\n"
            "      native.unavailable_reason('decode_attention'))\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PAGEDSERVE_CACHE=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=300, cwd=root)
    assert result.returncode == 0 and result.stdout.strip() == "built", result.stderr[-2000:]
    assert [path.parent.name.split("-")[0] for path in tmp_path.glob("kernels/*/*.so")] == [
        "decode_attention"]                 # only the feature it used
    env = dict(env, CC=str(tmp_path / "no-such-compiler"), PAGEDSERVE_CACHE=str(tmp_path / "b"))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=300, cwd=root)
    assert result.returncode == 0 and result.stdout.startswith(
        "native decode_attention kernels unavailable: ") and "no-such-compiler" in result.stdout


_VARIANT_CHECK = """
import torch
from paged_inputs import make_kv_cache, rel_error, shuffled_block_tables
from pagedserve.kernels import native
from pagedserve.kernels.native_decode_attention import paged_decode_attention_native
from pagedserve.kernels.paged_decode_attention import paged_decode_attention_ref
assert native.library("decode_attention") is not None, native.unavailable_reason("decode_attention")
rng = torch.Generator().manual_seed(0)
for dtype, cache, tol in ((torch.float32, None, 1e-5), (torch.bfloat16, None, 2e-2),
                         (torch.float32, torch.float8_e4m3fn, 1e-5),
                         (torch.float32, torch.float8_e5m2, 1e-5)):
    for hq, hkv, d in ((9, 3, 64), (8, 1, 128), (4, 4, 64)):
        lens = [70, 1, 17, 1100, 5, 513, 64]
        blocks = sum(-(-n // 16) for n in lens) + 3
        kv = make_kv_cache(rng, 1, blocks, 16, hkv, d, dtype)
        if cache is not None:
            kv = kv.to(cache)
        tables = shuffled_block_tables(rng, lens, 16, blocks)
        q = torch.randn(len(lens), hq, d, generator=rng).to(dtype)
        args = (q, kv[0, 0], kv[0, 1], tables, torch.tensor(lens, dtype=torch.int32), d ** -0.5)
        err = rel_error(paged_decode_attention_native(*args), paged_decode_attention_ref(*args))
        assert err < tol, (dtype, hq, hkv, d, err)
from pagedserve.kernels import native_linear   # the fp32 and bf16 linears with the same flags
for dtype, rtol in ((torch.float32, 1e-5), (torch.bfloat16, 2.0 ** -8)):
    for m, n, k in ((1, 17, 576), (7, 100, 33), (13, 64, 1536)):
        w = torch.randn(n, k, generator=rng).to(dtype)
        x = torch.randn(m, k, generator=rng).to(dtype)
        out = native_linear.linear(x, native_linear.pack(w), n)
        assert out.dtype == dtype and torch.allclose(
            out.double(), x.double() @ w.double().t(), rtol=rtol, atol=1e-3), (dtype, m, n, k)
print("ok")
"""


@pytest.mark.parametrize("cflags", [
    pytest.param("-mno-avx512f", id="avx2", marks=pytest.mark.skipif(
        "avx512f" not in native.cpu_flags(),
        reason="the default build of this CPU is the AVX2 one")),
    pytest.param("-mno-avx512f -mno-avx2 -mno-fma", id="portable")])
def test_narrower_isa_builds_match_the_reference(tmp_path, cflags):
    # On an AVX-512 CPU -march=native takes the 16-lane path; these builds check the 8-lane
    # AVX2 body and the portable one at the same shapes.
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    env = dict(os.environ, PAGEDSERVE_CACHE=str(tmp_path), PAGEDSERVE_NATIVE_CFLAGS=cflags,
               PYTHONPATH=os.pathsep.join([here, root]))
    result = subprocess.run([sys.executable, "-c", _VARIANT_CHECK], env=env, capture_output=True,
                            text=True, timeout=600, cwd=root)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
