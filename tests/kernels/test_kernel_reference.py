"""The torch references (the CPU serving path) against obviously-correct per-sequence code,
and the backend dispatch."""
import os
import subprocess
import sys

import pytest
import torch
from paged_inputs import (WINDOW_SHAPES, make_kv_cache, naive_attention, rel_error,
                          shuffled_block_tables, window_case)

from pagedserve import envs, kernels
from pagedserve.kernels.triton_copy_blocks import copy_blocks_ref
from pagedserve.kernels.triton_decode_attention import paged_decode_attention_ref
from pagedserve.kernels.triton_prefill_attention import paged_prefill_attention_ref
from pagedserve.kernels.triton_store_kv import store_kv_ref
from pagedserve.kernels.swap_blocks import swap_blocks_ref

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(9, 3), (4, 4)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_ref_matches_naive(rng, dtype, num_q_heads, num_kv_heads, block_size):
    context_lens = [1, 17, block_size * 3, 70]
    kv_cache = make_kv_cache(rng, 2, 24, block_size, num_kv_heads, 64, dtype)
    k_cache, v_cache = kv_cache[1, 0], kv_cache[1, 1]
    tables = shuffled_block_tables(rng, context_lens, block_size, 24)
    q = torch.randn(len(context_lens), num_q_heads, 64, generator=rng).to(dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    out = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.125)
    assert out.shape == q.shape and out.dtype == dtype
    for b, context_len in enumerate(context_lens):
        expected = naive_attention(q[b:b + 1], k_cache, v_cache, tables[b], context_len, 1, 0.125)
        assert rel_error(out[b:b + 1], expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(9, 3), (4, 4)])
def test_prefill_ref_matches_naive(rng, dtype, num_q_heads, num_kv_heads):
    block_size = 16
    q_lens = [5, 16, 1, 30]
    context_lens = [5, 16 + 16, 40, 61]     # whole prompt, chunk after a prefix, decode-like row
    kv_cache = make_kv_cache(rng, 1, 20, block_size, num_kv_heads, 32, dtype)
    k_cache, v_cache = kv_cache[0, 0], kv_cache[0, 1]
    tables = shuffled_block_tables(rng, context_lens, block_size, 20)
    cu = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    q = torch.randn(cu[-1], num_q_heads, 32, generator=rng).to(dtype)
    out = paged_prefill_attention_ref(q, k_cache, v_cache, tables,
                                      torch.tensor(cu, dtype=torch.int32),
                                      torch.tensor(context_lens, dtype=torch.int32), 0.3)
    for s, context_len in enumerate(context_lens):
        expected = naive_attention(q[cu[s]:cu[s + 1]], k_cache, v_cache, tables[s], context_len,
                                   q_lens[s], 0.3)
        assert rel_error(out[cu[s]:cu[s + 1]], expected) < TOLERANCE[dtype]


def test_naive_window_is_a_dense_masked_softmax(rng):
    """The test's naive_attention with a window, against softmax over a mask built by hand."""
    k_cache = torch.randn(3, 4, 1, 8, generator=rng)
    v_cache = torch.randn(3, 4, 1, 8, generator=rng)
    table = torch.tensor([2, 0, 1], dtype=torch.int32)
    q = torch.randn(3, 2, 8, generator=rng)                 # positions 8, 9, 10 of 11
    out = naive_attention(q, k_cache, v_cache, table, 11, 3, 0.5, window=4)
    keys = k_cache[table.long()].flatten(0, 1)[:11, 0].double()
    values = v_cache[table.long()].flatten(0, 1)[:11, 0].double()
    for row, pos in enumerate((8, 9, 10)):
        seen = torch.tensor([pos - 4 < j <= pos for j in range(11)])
        scores = (q[row].double() @ keys.T * 0.5).masked_fill(~seen, float("-inf"))
        assert torch.allclose(out[row], scores.softmax(-1) @ values)


@pytest.mark.parametrize("window", [0, 20, 600])
@pytest.mark.parametrize("head_dim,num_q_heads,num_kv_heads", WINDOW_SHAPES)
def test_windowed_refs_match_naive_and_skip_dead_blocks(rng, head_dim, num_q_heads,
                                                        num_kv_heads, window):
    """Sliding windows shorter and longer than the contexts, with the blocks wholly before each
    window full of NaN (freed and reused elsewhere): the output stays finite and right."""
    decode = window_case(rng, [1, 5, 40, 300, 33], [1] * 5, 16, head_dim, num_q_heads,
                         num_kv_heads, window)
    out = paged_decode_attention_ref(*decode.decode_args(), window=window)
    assert rel_error(out, decode.expected) < 1e-5
    prefill = window_case(rng, [7, 45, 61, 3], [7, 13, 30, 1], 16, head_dim, num_q_heads,
                          num_kv_heads, window)
    out = paged_prefill_attention_ref(*prefill.prefill_args(), window=window)
    assert rel_error(out, prefill.expected) < 1e-5


def test_store_kv_ref_writes_slots_and_skips_minus_one(rng):
    kv_cache = torch.zeros(1, 2, 4, 16, 2, 8)
    key = torch.randn(3, 2, 8, generator=rng)
    value = torch.randn(3, 2, 8, generator=rng)
    store_kv_ref(key, value, kv_cache[0, 0], kv_cache[0, 1], torch.tensor([37, -1, 5]))
    assert torch.equal(kv_cache[0, 0, 2, 5], key[0]) and torch.equal(kv_cache[0, 1, 2, 5], value[0])
    assert torch.equal(kv_cache[0, 0, 0, 5], key[2]) and torch.equal(kv_cache[0, 1, 0, 5], value[2])
    assert (kv_cache != 0).sum() == 2 * 2 * 2 * 8


def test_copy_and_swap_refs_move_whole_blocks(rng):
    device_pool = torch.randn(2, 2, 6, 16, 2, 8, generator=rng)
    host_pool = torch.zeros(2, 2, 3, 16, 2, 8)
    before = device_pool.clone()
    copy_blocks_ref(device_pool, torch.tensor([[1, 4], [2, 5]]))
    assert torch.equal(device_pool[:, :, 4], before[:, :, 1])
    assert torch.equal(device_pool[:, :, 5], before[:, :, 2])
    assert torch.equal(device_pool[:, :, :4], before[:, :, :4])
    swap_blocks_ref(device_pool, host_pool, torch.tensor([[3, 0], [0, 2]]))
    assert torch.equal(host_pool[:, :, 0], before[:, :, 3])
    assert torch.equal(host_pool[:, :, 2], before[:, :, 0])
    assert (host_pool[:, :, 1] == 0).all()
    device_pool.zero_()
    swap_blocks_ref(host_pool, device_pool, torch.tensor([[2, 5]]))
    assert torch.equal(device_pool[:, :, 5], before[:, :, 0])


def test_wrappers_reject_bad_arguments():
    kv_cache = torch.zeros(1, 2, 4, 16, 2, 8)
    k_cache, v_cache = kv_cache[0, 0], kv_cache[0, 1]
    with pytest.raises(ValueError, match="slot_mapping must be torch.int64"):
        store_kv_ref(torch.zeros(1, 2, 8), torch.zeros(1, 2, 8), k_cache, v_cache,
                     torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="not a multiple of Hkv"):
        paged_decode_attention_ref(torch.zeros(1, 3, 8), k_cache, v_cache,
                                   torch.zeros(1, 1, dtype=torch.int32),
                                   torch.ones(1, dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match=r"block_mapping must be \[N, 2\]"):
        copy_blocks_ref(kv_cache, torch.zeros(3, dtype=torch.int64))


def test_dispatch_uses_torch_for_cpu_tensors(monkeypatch, rng):
    called = []
    from pagedserve.kernels import triton_decode_attention
    monkeypatch.setattr(triton_decode_attention, "paged_decode_attention_triton",
                        lambda *args: called.append("triton"))
    kv_cache = make_kv_cache(rng, 1, 4, 16, 2, 16, torch.float32)
    args = (torch.randn(1, 4, 16, generator=rng), kv_cache[0, 0], kv_cache[0, 1],
            torch.tensor([[2]], dtype=torch.int32), torch.tensor([5], dtype=torch.int32), 0.25)
    assert kernels.get_backend() == "auto"
    assert kernels.paged_decode_attention(*args).shape == (1, 4, 16) and called == []
    with envs.override(kernels="triton"):
        kernels.paged_decode_attention(*args)
    assert called == ["triton"]
    try:
        kernels.set_backend("triton")           # the API overrides the setting
        kernels.paged_decode_attention(*args)
        assert called == ["triton"] * 2
    finally:
        kernels.set_backend(None)
    assert kernels.get_backend() == "auto"
    with pytest.raises(ValueError, match="expected one of auto, triton, torch"):
        kernels.set_backend("cuda")


def test_imports_and_serves_on_cpu_without_interpreter():
    """A CPU-only host without TRITON_INTERPRET runs the torch path through the dispatch without
    importing Triton, and imports the Triton kernel modules when asked."""
    code = (
        "import importlib, sys, torch\nimport pagedserve.kernels as kernels\n"
        "kv = torch.zeros(1, 2, 2, 16, 1, 16)\n"
        "kernels.store_kv(torch.ones(1, 1, 16), torch.ones(1, 1, 16), kv[0, 0], kv[0, 1],"
        " torch.tensor([3]))\n"
        "out = kernels.paged_decode_attention(torch.ones(1, 1, 16), kv[0, 0], kv[0, 1],"
        " torch.tensor([[0]], dtype=torch.int32), torch.tensor([4], dtype=torch.int32), 1.0)\n"
        "assert kv[0, 0, 0, 3].sum() == 16 and torch.isfinite(out).all()\n"
        "assert 'triton' not in sys.modules   # the torch path never needs it\n"
        "s = importlib.import_module('pagedserve.kernels.triton_store_kv')\n"
        "from triton.runtime.jit import JITFunction\n"
        "assert isinstance(s._store_kv_kernel, JITFunction)\n"
        "assert callable(kernels.store_kv)   # the package's function, not shadowed\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PAGEDSERVE_KERNELS")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                            timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                                os.path.abspath(__file__)))))
    assert result.returncode == 0, result.stderr[-3000:]
