"""The chunked CPU decode path against the torch reference and the naive per-sequence attention."""
import os
import subprocess
import sys

import pytest
import torch
from paged_inputs import (WINDOW_SHAPES, make_kv_cache, naive_attention, rel_error,
                          shuffled_block_tables, window_case)

from pagedserve import envs, kernels
from pagedserve.kernels import cpu_decode_attention
from pagedserve.kernels.cpu_decode_attention import bucket_bounds, paged_decode_attention_cpu
from pagedserve.kernels.triton_decode_attention import paged_decode_attention_ref

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _random_decode_inputs(rng, context_lens, num_q_heads, num_kv_heads, block_size, dtype,
                          num_blocks=None):
    num_blocks = num_blocks or sum(-(-n // block_size) for n in context_lens) + 5
    kv_cache = make_kv_cache(rng, 2, num_blocks, block_size, num_kv_heads, 64, dtype)
    tables = shuffled_block_tables(rng, context_lens, block_size, num_blocks)
    q = torch.randn(len(context_lens), num_q_heads, 64, generator=rng).to(dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    return q, kv_cache[1, 0], kv_cache[1, 1], tables, lens, 0.125


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(9, 3), (4, 4)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("ratio,max_buckets", [(0.6, 4), (1.0, 100), (0.0, 1)])
def test_matches_reference_and_naive(monkeypatch, rng, dtype, num_q_heads, num_kv_heads,
                                     block_size, ratio, max_buckets):
    # (1.0, 100): one row per bucket; (0.0, 1): a single bucket, no reordering.
    monkeypatch.setattr(cpu_decode_attention, "BUCKET_RATIO", ratio)
    monkeypatch.setattr(cpu_decode_attention, "MAX_BUCKETS", max_buckets)
    context_lens = [70, 1, 17, block_size * 3, 200, 5, block_size, 129, 1, 64]
    args = _random_decode_inputs(rng, context_lens, num_q_heads, num_kv_heads, block_size, dtype)
    out = paged_decode_attention_cpu(*args)
    expected = paged_decode_attention_ref(*args)
    assert out.shape == expected.shape and out.dtype == dtype
    assert rel_error(out, expected) < TOLERANCE[dtype]
    q, k_cache, v_cache, tables, _, scale = args
    for b, context_len in enumerate(context_lens):
        naive = naive_attention(q[b:b + 1], k_cache, v_cache, tables[b], context_len, 1, scale)
        assert rel_error(out[b:b + 1], naive) < TOLERANCE[dtype], f"row {b} (context {context_len})"


@pytest.mark.parametrize("window", [0, 20, 600])
@pytest.mark.parametrize("head_dim,num_q_heads,num_kv_heads", WINDOW_SHAPES)
def test_sliding_window_skips_dead_blocks(rng, head_dim, num_q_heads, num_kv_heads, window):
    # buckets by the span from each row's first visible block; blocks before it hold NaN
    case = window_case(rng, [1, 5, 40, 300, 33, 90], [1] * 6, 16, head_dim, num_q_heads,
                       num_kv_heads, window)
    out = paged_decode_attention_cpu(*case.decode_args(), window=window)
    assert rel_error(out, case.expected) < 1e-5


def test_rows_keep_their_order_and_ignore_table_padding(rng):
    """Sorting by length must not move outputs between rows; -1 padding past a row's pages and
    equal lengths (stable sort) are fine."""
    context_lens = [33, 33, 2, 100, 33]
    q, k_cache, v_cache, tables, lens, scale = _random_decode_inputs(
        rng, context_lens, 4, 2, 16, torch.float32)
    padded = torch.cat([tables, torch.full((len(context_lens), 3), -1, dtype=torch.int32)], 1)
    out = paged_decode_attention_cpu(q, k_cache, v_cache, padded, lens, scale)
    for b in range(len(context_lens)):
        alone = paged_decode_attention_ref(q[b:b + 1], k_cache, v_cache, tables[b:b + 1],
                                           lens[b:b + 1], scale)
        assert rel_error(out[b:b + 1], alone) < 1e-5, f"row {b}"


def test_bucket_bounds():
    blocks = [32, 30, 20, 19, 12, 11, 7, 3, 1, 1]
    assert bucket_bounds(blocks, 0.6, 10) == [(0, 3), (3, 5), (5, 7), (7, 8), (8, 10)]
    assert bucket_bounds(blocks, 0.6, 2) == [(0, 3), (3, 10)]
    assert bucket_bounds([4, 4, 4], 0.6, 4) == [(0, 3)]
    assert bucket_bounds([5], 0.6, 4) == [(0, 1)]


def test_large_batch_bf16_equals_reference(rng):
    """A serving-sized ragged batch, bf16: what the reference gives (the same SDPA on the same
    pages, row by row)."""
    context_lens = torch.randint(1, 300, (96,), generator=rng).tolist()
    args = _random_decode_inputs(rng, context_lens, 9, 3, 16, torch.bfloat16)
    assert rel_error(paged_decode_attention_cpu(*args), paged_decode_attention_ref(*args)) < 1e-2


def test_empty_batch_and_argument_checks():
    kv_cache = torch.zeros(1, 2, 4, 16, 2, 8)
    empty = paged_decode_attention_cpu(torch.zeros(0, 4, 8), kv_cache[0, 0], kv_cache[0, 1],
                                       torch.zeros(0, 1, dtype=torch.int32),
                                       torch.zeros(0, dtype=torch.int32), 1.0)
    assert empty.shape == (0, 4, 8)
    with pytest.raises(ValueError, match="context_lens must be torch.int32"):
        paged_decode_attention_cpu(torch.zeros(1, 4, 8), kv_cache[0, 0], kv_cache[0, 1],
                                   torch.zeros(1, 1, dtype=torch.int32),
                                   torch.ones(1, dtype=torch.int64), 1.0)


def test_dispatch_serves_cpu_tensors_with_the_selected_path(monkeypatch, rng):
    called = []
    monkeypatch.setitem(kernels._DECODE_CPU, "bucketed",
                        lambda *args: called.append("cpu") or paged_decode_attention_cpu(*args))
    args = _random_decode_inputs(rng, [5, 40], 4, 2, 16, torch.float32)
    with envs.override(decode_cpu="bucketed"):
        out = kernels.paged_decode_attention(*args)
    assert called == ["cpu"] and rel_error(out, paged_decode_attention_ref(*args)) < 1e-5


def test_setting_selects_the_decode_path():
    paths = {}
    for value in ("ref", "bucketed", "native"):
        with envs.override(decode_cpu=value):
            paths[value] = kernels.cpu_decode_kernel()
    assert paths == {"ref": paged_decode_attention_ref, "bucketed": paged_decode_attention_cpu,
                     "native": kernels._decode_native}


def test_env_var_selects_the_decode_path_in_a_fresh_process():
    # read at the first kernel call, not at import: a bad value fails there, with its name
    code = ("import pagedserve.kernels as kernels\n"
            "print(kernels.cpu_decode_kernel().__name__)\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    seen = []
    # one value other than the default, and a bad one (test_setting_selects_the_decode_path
    # covers every value in-process): each fresh process costs an import of torch
    for value in ("bucketed", "fast"):
        env = dict(os.environ, PAGEDSERVE_DECODE_CPU=value)
        result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                text=True, timeout=120, cwd=root)
        seen.append(result.stdout.strip() if result.returncode == 0 else result.stderr)
    assert seen[0] == "paged_decode_attention_cpu"
    assert "Error: PAGEDSERVE_DECODE_CPU='fast': expected one of native, bucketed, ref" in seen[1]
