"""Time the CPU (torch) kernels at SmolLM2 shapes; last line is one JSON object, stored under
benchmarks/results/bench_kernels/ (scripts/bench_record.py) unless --no-store.

    .venv/bin/python scripts/bench_kernels.py [--batch 256] [--context 512] [--repeats 10]

Decode is timed three ways: decode_ref_* is paged_decode_attention_ref (the plain reference),
decode_bucketed_* is paged_decode_attention_cpu (gather + SDPA by length bucket) and decode_* is
paged_decode_attention_native (the C kernel, the CPU serving path), each on equal-length and on
ragged (uniform 1..context) batches. Times are medians; *_cpu_ms is the process CPU time, steadier than
wall time on a shared box (divide by the thread count for a wall-time equivalent).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_record  # noqa: E402
from pagedserve.kernels.cpu_decode_attention import paged_decode_attention_cpu  # noqa: E402
from pagedserve.kernels.native_decode_attention import paged_decode_attention_native  # noqa: E402
from pagedserve.kernels.triton_decode_attention import paged_decode_attention_ref  # noqa: E402
from pagedserve.kernels.triton_prefill_attention import paged_prefill_attention_ref  # noqa: E402
from pagedserve.kernels.triton_store_kv import store_kv_ref  # noqa: E402

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16   # SmolLM2-135M


def best_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def median_ms(fn, repeats: int) -> tuple[float, float]:
    """(median wall ms, median process-CPU ms)."""
    fn()
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        cpu.append(time.process_time() - start_cpu)
        wall.append(time.perf_counter() - start)
    return statistics.median(wall) * 1e3, statistics.median(cpu) * 1e3


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=10)
    bench_record.add_no_store_flag(parser)
    args = parser.parse_args(argv)
    batch, context, dtype = args.batch, args.context, torch.bfloat16
    blocks_per_seq = context // BLOCK_SIZE
    num_blocks = batch * blocks_per_seq + 8
    gen = torch.Generator().manual_seed(0)
    kv_cache = torch.randn(1, 2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM,
                           generator=gen).to(dtype)
    k_cache, v_cache = kv_cache[0, 0], kv_cache[0, 1]
    tables = torch.randperm(num_blocks, generator=gen)[:batch * blocks_per_seq]
    tables = tables.view(batch, blocks_per_seq).to(torch.int32)
    context_lens = torch.full((batch,), context, dtype=torch.int32)
    q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, generator=gen).to(dtype)
    scale = HEAD_DIM ** -0.5
    results = {"threads": torch.get_num_threads(), "batch": batch, "context": context,
               "dtype": "bfloat16", "loadavg_1m": float(os.getloadavg()[0])}

    ragged_lens = torch.randint(1, context + 1, (batch,), generator=gen, dtype=torch.int32)
    for label, lens in (("", context_lens), ("_ragged", ragged_lens)):
        # Interleave old and new so both see the same machine load.
        paths = (("decode_ref", paged_decode_attention_ref),
                 ("decode_bucketed", paged_decode_attention_cpu),
                 ("decode", paged_decode_attention_native))
        for name, fn in paths + paths:
            wall, cpu = median_ms(lambda: fn(q, k_cache, v_cache, tables, lens, scale),
                                  args.repeats)
            for key, value in ((f"{name}{label}_ms", wall), (f"{name}{label}_cpu_ms", cpu)):
                results[key] = min(results.get(key, value), value)
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * kv_cache.element_size()
    results["decode_kv_gb_s"] = kv_bytes / results["decode_ms"] / 1e6
    results["decode_speedup"] = results["decode_ref_ms"] / results["decode_ms"]
    results["decode_ragged_speedup"] = results["decode_ref_ragged_ms"] / results["decode_ragged_ms"]
    results["decode_vs_bucketed"] = results["decode_bucketed_ms"] / results["decode_ms"]

    def decode_sdpa_fresh_gather():   # the reference without its reused scratch buffers
        ids = tables.reshape(-1).long()
        keys = k_cache.index_select(0, ids).view(batch, context, NUM_KV_HEADS, HEAD_DIM)
        values = v_cache.index_select(0, ids).view(batch, context, NUM_KV_HEADS, HEAD_DIM)
        return F.scaled_dot_product_attention(
            q.view(batch, NUM_Q_HEADS, 1, HEAD_DIM), keys.transpose(1, 2), values.transpose(1, 2),
            scale=scale, enable_gqa=True)
    results["decode_sdpa_fresh_alloc_ms"] = best_ms(decode_sdpa_fresh_gather, args.repeats)

    def decode_fp32_einsum():         # fp32 matmul + softmax on the gathered pages
        ids = tables.reshape(-1).long()
        keys = k_cache.index_select(0, ids).view(batch, context, NUM_KV_HEADS, HEAD_DIM)
        values = v_cache.index_select(0, ids).view(batch, context, NUM_KV_HEADS, HEAD_DIM)
        grouped = q.view(batch, NUM_KV_HEADS, NUM_Q_HEADS // NUM_KV_HEADS, HEAD_DIM).float()
        scores = torch.einsum("bhgd,bthd->bhgt", grouped, keys.float()) * scale
        return torch.einsum("bhgt,bthd->bhgd", scores.softmax(-1), values.float())
    results["decode_fp32_einsum_ms"] = best_ms(decode_fp32_einsum, max(2, args.repeats // 3))

    slots = torch.arange(batch, dtype=torch.int64) * BLOCK_SIZE
    new_k = torch.randn(batch, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    results["store_kv_decode_ms"] = best_ms(
        lambda: store_kv_ref(new_k, new_k, k_cache, v_cache, slots), args.repeats)

    prompt = min(512, context)
    prefill_q = torch.randn(prompt, NUM_Q_HEADS, HEAD_DIM, generator=gen).to(dtype)
    results["prefill_512_ms"] = best_ms(lambda: paged_prefill_attention_ref(
        prefill_q, k_cache, v_cache, tables[:1], torch.tensor([0, prompt], dtype=torch.int32),
        torch.tensor([prompt], dtype=torch.int32), scale), args.repeats)

    for key, value in results.items():
        print(f"{key:>28}: {value:.2f}" if isinstance(value, float) else f"{key:>28}: {value}")
    results = {k: round(v, 3) if isinstance(v, float) else v for k, v in results.items()}
    bench_record.finish("bench_kernels", results, args.no_store, argv)
    return results


if __name__ == "__main__":
    main()
