"""Every Triton kernel against its torch reference (interpreter on CPU, compiled on a GPU)."""
import os
import subprocess
import sys

import pytest
import torch
from triton_mode import run_in_interpreter, triton_runs_here
from paged_inputs import (WINDOW_SHAPES, chunked_prefill, make_kv_cache, rel_error,
                          shuffled_block_tables, window_case)

from pagedserve.kernels import _checks


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Kernel outputs start as NaN, so any element a kernel forgets to write fails the test."""
    def nan_output(shape, like):
        return torch.full(shape, float("nan"), dtype=like.dtype, device=like.device)
    monkeypatch.setattr(_checks, "new_output", nan_output)


HEADS = [(9, 3), (4, 4)]


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_matches_reference(triton_kernels, poisoned_outputs, rng, device, block_size,
                                  num_q_heads, num_kv_heads, dtype):
    module = triton_kernels["paged_decode_attention"]
    context_lens = [1, block_size, 2 * block_size + 5, 3 * block_size - 1]
    head_dim = 32
    kv_cache = make_kv_cache(rng, 2, 16, block_size, num_kv_heads, head_dim, dtype).to(device)
    k_cache, v_cache = kv_cache[1, 0], kv_cache[1, 1]
    tables = shuffled_block_tables(rng, context_lens, block_size, 16).to(device)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    # q as a strided view of a wider projection, like the model's fused qkv output.
    qkv = torch.randn(len(context_lens), num_q_heads + 2, head_dim, generator=rng).to(device, dtype)
    q = qkv[:, :num_q_heads]
    scale = head_dim ** -0.5
    out = module.paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, scale)
    expected = module.paged_decode_attention_ref(q.float(), k_cache.float(), v_cache.float(),
                                                 tables, lens, scale)
    assert rel_error(out, expected) < (1e-3 if dtype == torch.float32 else 5e-3)


@pytest.mark.parametrize("num_partitions", [2, 5])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_split_over_partitions_matches_reference(triton_kernels, poisoned_outputs, rng,
                                                        device, block_size, num_partitions):
    """Flash-decoding: each context split into partitions whose partial results are combined;
    wide (padded) tables leave some partitions empty for the short contexts."""
    module = triton_kernels["paged_decode_attention"]
    context_lens = [1, 300, 2 * block_size + 5, 190, 64]
    num_blocks = 60
    kv_cache = make_kv_cache(rng, 1, num_blocks, block_size, 3, 32, torch.float32).to(device)
    k_cache, v_cache = kv_cache[0, 0], kv_cache[0, 1]
    width = -(-320 // block_size)
    tables = shuffled_block_tables(rng, context_lens, block_size, num_blocks,
                                   pad_to=width).to(device)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    q = torch.randn(len(context_lens), 9, 32, generator=rng).to(device)
    out = module.paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, 0.3,
                                               num_partitions=num_partitions)
    expected = module.paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.3)
    assert rel_error(out, expected) < 1e-3


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", HEADS)
def test_prefill_matches_reference(triton_kernels, poisoned_outputs, rng, device, block_size,
                                   num_q_heads, num_kv_heads):
    """Ragged batch: a whole prompt, a chunk after a cached prefix, a 1-token chunk, and a chunk
    longer than one query tile."""
    module = triton_kernels["paged_prefill_attention"]
    head_dim = 16
    q_lens = [7, 13, 1, 40]
    context_lens = [7, block_size + 21, 2 * block_size + 3, 45]
    kv_cache = make_kv_cache(rng, 1, 20, block_size, num_kv_heads, head_dim, torch.float32)
    k_cache, v_cache = kv_cache[0, 0].to(device), kv_cache[0, 1].to(device)
    tables = shuffled_block_tables(rng, context_lens, block_size, 20).to(device)
    cu_seqlens = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                              device=device)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=rng).to(device)
    scale = 0.7
    out = module.paged_prefill_attention_triton(q, k_cache, v_cache, tables, cu_seqlens, lens,
                                                scale)
    expected = module.paged_prefill_attention_ref(q, k_cache, v_cache, tables, cu_seqlens, lens,
                                                  scale)
    assert rel_error(out, expected) < 1e-3


@pytest.mark.parametrize("window", [0, 24, 1000])
@pytest.mark.parametrize("head_dim,num_q_heads,num_kv_heads", WINDOW_SHAPES)
def test_sliding_window_matches_naive_and_skips_dead_blocks(triton_kernels, poisoned_outputs, rng,
                                                            device, head_dim, num_q_heads,
                                                            num_kv_heads, window):
    """Windows shorter and longer than the contexts over head sizes 64/128/256 and GQA groups
    1/4/7/16, the blocks wholly before each window full of NaN (freed, reused elsewhere)."""
    decode = triton_kernels["paged_decode_attention"]
    case = window_case(rng, [1, 40, 150, 33], [1] * 4, 16, head_dim, num_q_heads, num_kv_heads,
                       window, device=device)
    out = decode.paged_decode_attention_triton(*case.decode_args(), window=window)
    assert rel_error(out, case.expected) < 1e-3
    prefill = triton_kernels["paged_prefill_attention"]
    case = window_case(rng, [70, 3], [10, 1], 16, head_dim, num_q_heads, num_kv_heads, window,
                       device=device)
    out = prefill.paged_prefill_attention_triton(*case.prefill_args(), window=window)
    assert rel_error(out, case.expected) < 1e-3


@pytest.mark.parametrize("num_partitions", [2, 5])
def test_sliding_window_split_over_partitions(triton_kernels, poisoned_outputs, rng, device,
                                              num_partitions):
    """Flash-decoding under a window: partitions count from each row's first visible block."""
    decode = triton_kernels["paged_decode_attention"]
    case = window_case(rng, [300, 140, 7], [1] * 3, 16, 32, 6, 2, 150, device=device)
    out = decode.paged_decode_attention_triton(*case.decode_args(), window=150,
                                               num_partitions=num_partitions)
    assert rel_error(out, case.expected) < 1e-3


@pytest.mark.parametrize("window", [0, 40])
def test_tiles_smaller_than_a_page(triton_kernels, poisoned_outputs, rng, device, monkeypatch,
                                   window):
    """Where a page's K/V would not fit in shared memory (fp32, head_dim 256, block size 128 on
    a GPU), the kernels read parts of pages: forced here with a tiny tile budget."""
    monkeypatch.setattr(_checks, "KV_TILE_BYTES", 16 * 32 * 4)       # 16 fp32 rows of 32
    assert _checks.kv_tile_tokens(64, 32, 4) == 16
    case = window_case(rng, [90, 5], [30, 2], 64, 32, 4, 2, window, device=device)
    prefill = triton_kernels["paged_prefill_attention"]
    out = prefill.paged_prefill_attention_triton(*case.prefill_args(), window=window)
    assert rel_error(out, case.expected) < 1e-3
    decode = window_case(rng, [90, 5, 200], [1] * 3, 64, 32, 4, 2, window, device=device)
    out = triton_kernels["paged_decode_attention"].paged_decode_attention_triton(
        *decode.decode_args(), window=window)
    assert rel_error(out, decode.expected) < 1e-3


def test_chunked_prefill_across_the_window_edge(triton_kernels, poisoned_outputs, rng, device):
    """Chunks of 7 under a window of 16: each chunk's rows start their windows in different
    blocks, and the blocks behind the first row's window hold NaN."""
    prefill = triton_kernels["paged_prefill_attention"]
    k_cache, v_cache, table, scale, steps = chunked_prefill(rng, 45, 7, 16, 16, num_q_heads=7,
                                                            num_kv_heads=1)
    for step in steps:
        rows = step.context_len - step.start
        out = prefill.paged_prefill_attention_triton(
            step.q.to(device), k_cache.to(device), v_cache.to(device), table.to(device),
            torch.tensor([0, rows], dtype=torch.int32, device=device),
            torch.tensor([step.context_len], dtype=torch.int32, device=device), scale, window=16)
        assert rel_error(out, step.expected) < 1e-3, step.start


@pytest.mark.parametrize("block_size", [16, 32])
def test_store_kv_matches_reference(triton_kernels, rng, device, block_size):
    module = triton_kernels["store_kv"]
    num_kv_heads, head_dim, num_blocks = 3, 24, 6   # non power-of-two heads and dims: masked
    kv_cache = torch.full((2, 2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"),
                          device=device)
    expected = kv_cache.clone()
    slots = torch.randperm(num_blocks * block_size, generator=rng)[:10]
    slots[3] = slots[7] = -1
    slots = slots.to(device)
    key = torch.randn(10, num_kv_heads, head_dim, generator=rng).to(device)
    value = torch.randn(10, num_kv_heads, head_dim, generator=rng).to(device)
    module.store_kv_triton(key, value, kv_cache[1, 0], kv_cache[1, 1], slots)
    module.store_kv_ref(key, value, expected[1, 0], expected[1, 1], slots)
    assert torch.equal(kv_cache.isnan(), expected.isnan())
    written = ~expected.isnan()
    assert written.sum() == 8 * 2 * num_kv_heads * head_dim   # the two -1 slots were skipped
    assert torch.equal(kv_cache[written], expected[written])


@pytest.mark.parametrize("block_size", [16, 32])
def test_copy_blocks_matches_reference(triton_kernels, rng, device, block_size):
    module = triton_kernels["copy_blocks"]
    kv_cache = make_kv_cache(rng, 3, 10, block_size, 2, 16, torch.float32).to(device)
    kv_cache[:, :, 6:] = float("nan")                    # destinations start poisoned
    expected = kv_cache.clone()
    mapping = torch.tensor([[4, 7], [0, 9], [4, 6]], dtype=torch.int64, device=device)
    module.copy_blocks_triton(kv_cache, mapping)
    module.copy_blocks_ref(expected, mapping)
    assert torch.equal(kv_cache[:, :, :8], expected[:, :, :8])
    assert torch.equal(kv_cache[:, :, 9], expected[:, :, 9])
    assert torch.equal(kv_cache[:, :, 7], kv_cache[:, :, 4])
    assert kv_cache[:, :, 8].isnan().all()               # untouched block stays untouched


NARROW_CACHES = [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16]


@pytest.mark.parametrize("cache_dtype", NARROW_CACHES)
def test_attention_reads_narrow_caches_like_the_reference(triton_kernels, poisoned_outputs, rng,
                                                          device, cache_dtype):
    """fp32 queries over an fp8 or bf16 cache (kernels/kv_format.py): the kernels widen each
    element by bit manipulation, the references by torch's conversion; both must agree."""
    from pagedserve.kernels.kv_format import to_storage
    block_size, num_q_heads, num_kv_heads, head_dim = 16, 9, 3, 32
    kv_cache = make_kv_cache(rng, 1, 12, block_size, num_kv_heads, head_dim, torch.float32)
    # spread over fp8's range: normals, subnormals (e4m3 below 2**-6) and saturation
    kv_cache = to_storage(kv_cache * torch.logspace(-3, 3, head_dim), cache_dtype).to(device)
    k_cache, v_cache = kv_cache[0, 0], kv_cache[0, 1]
    context_lens = [1, 21, 40, 7]
    tables = shuffled_block_tables(rng, context_lens, block_size, 12).to(device)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    decode = triton_kernels["paged_decode_attention"]
    q = torch.randn(len(context_lens), num_q_heads, head_dim, generator=rng).to(device) * 0.05
    out = decode.paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, 0.1)
    assert rel_error(out, decode.paged_decode_attention_ref(q, k_cache, v_cache, tables, lens,
                                                            0.1)) < 1e-3
    prefill = triton_kernels["paged_prefill_attention"]
    q_lens = [1, 13, 40, 2]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                      device=device)
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=rng).to(device) * 0.05
    out = prefill.paged_prefill_attention_triton(q, k_cache, v_cache, tables, cu, lens, 0.1)
    assert rel_error(out, prefill.paged_prefill_attention_ref(q, k_cache, v_cache, tables, cu,
                                                              lens, 0.1)) < 1e-3


@pytest.mark.parametrize("cache_dtype", NARROW_CACHES)
def test_store_kv_converts_into_narrow_caches(triton_kernels, rng, device, cache_dtype):
    from pagedserve.kernels.kv_format import raw, to_storage
    module = triton_kernels["store_kv"]
    kv_cache = torch.zeros((1, 2, 4, 16, 3, 24), device=device).to(cache_dtype)
    expected = kv_cache.clone()
    slots = torch.tensor([5, -1, 63, 17, 0], device=device)
    key = torch.randn(5, 3, 24, generator=rng).to(device) * 100   # past e4m3's 448: saturates
    value = torch.randn(5, 3, 24, generator=rng).to(device)
    module.store_kv_triton(key, value, kv_cache[0, 0], kv_cache[0, 1], slots)
    module.store_kv_ref(key, value, expected[0, 0], expected[0, 1], slots)
    assert torch.equal(raw(kv_cache), raw(expected))
    assert kv_cache.float().isfinite().all()
    k_slots = kv_cache[0, 0].flatten(0, 1)
    assert torch.equal(raw(k_slots[5]), raw(to_storage(key[0], cache_dtype)))
    written = raw(k_slots).flatten(1).any(1).nonzero().flatten().tolist()
    assert written == [0, 5, 17, 63]                       # and slot -1 wrote nothing


@pytest.mark.skipif(triton_runs_here(), reason="the Triton tests above run in this process")
def test_triton_suite_in_subprocess():
    run_in_interpreter(__file__, "not in_subprocess and not compile_for_a_gpu")


def test_triton_kernels_compile_for_a_gpu(tmp_path):
    """Every kernel variant compiles to sm_90 machine code within its shared memory (no GPU
    needed; see compile_for_gpu.py): catches what the interpreter cannot, such as an unsupported
    dot shape or loop form, or tiles too big for a head size of 256. Quantized linears: every
    weight type at both tiles and both dot dtypes (--all: with every activation dtype)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)       # compile for real, not from an earlier cache
    script = os.path.join(os.path.dirname(__file__), "compile_for_gpu.py")
    proc = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and "\n0 failures" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.stdout.count(": ok (") >= 52                   # 34 attention/cache + 18 quant_linear
    assert proc.stdout.count(" quant_linear ") >= 18
    assert proc.stdout.count(" lora ") >= 6                    # shrink and expand, 3 dtypes

