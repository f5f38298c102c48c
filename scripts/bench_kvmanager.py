"""Benchmark the KV-cache manager: per-operation cost with 2,048 live sequences, and memory
efficiency on ShareGPT lengths against contiguous max-length preallocation.

    .venv/bin/python scripts/bench_kvmanager.py [--num-seqs 2048] [--samples 4000] [--seed 0]

The ShareGPT lengths are a seeded uniform sample of --samples first turns out of the whole file
(sharegpt.sample_first_turns), in that sample's order. Prints its numbers; the last line is one
JSON object, stored under benchmarks/results/bench_kvmanager/ (scripts/bench_record.py) unless
--no-store.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_record  # noqa: E402
import sharegpt  # noqa: E402
from pagedserve.kvmanager import KVCacheManager  # noqa: E402


def sharegpt_lengths(num_samples: int, max_model_len: int, seed: int,
                     dataset: str | None = None) -> list[tuple[int, int]]:
    """(prompt tokens, reply tokens) of first turns, tokenized with the default model."""
    from pagedserve.workers.loader import TEST_MODEL, resolve_model
    from pagedserve.pipeline.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model(TEST_MODEL))
    pairs = sharegpt.sample_first_turns(num_samples, seed, dataset)
    prompts = tokenizer([p for p, _ in pairs], add_special_tokens=False)["input_ids"]
    replies = tokenizer([r for _, r in pairs], add_special_tokens=False)["input_ids"]
    lengths = [(len(p), len(r)) for p, r in zip(prompts, replies)]
    # As vLLM's ShareGPT benchmark: drop pairs that do not fit the context window.
    return [(p, r) for p, r in lengths if p >= 1 and r >= 1 and p + r <= max_model_len]


def time_per_op(fn, items) -> float:
    start = time.perf_counter()
    for item in items:
        fn(item)
    return (time.perf_counter() - start) / len(items) * 1e6


def bench_ops(lengths, num_seqs: int, block_size: int, decode_steps: int) -> dict:
    rng = random.Random(0)
    chosen = [lengths[i % len(lengths)] for i in range(num_seqs)]
    total_blocks = sum(-(-(p + decode_steps + 1) // block_size) for p, _ in chosen)
    m = KVCacheManager(total_blocks + 4096, block_size, watermark=0.0)
    prompts = [[rng.randrange(50_000) for _ in range(p)] for p, _ in chosen]

    def allocate(i):
        assert m.allocate(i, prompts[i], len(prompts[i])) == 0

    alloc_us = time_per_op(allocate, range(num_seqs))
    for i in range(num_seqs):
        m.cache_blocks(i, prompts[i], len(prompts[i]))
    seq_ids = list(range(num_seqs))
    append = m.append_slots
    start = time.perf_counter()
    for _ in range(decode_steps):
        for seq_id in seq_ids:
            append(seq_id, 1)
    append_us = (time.perf_counter() - start) / (decode_steps * num_seqs) * 1e6
    # Lookups of cached prompts (each hashes its full blocks until the first miss).
    probes = [prompts[i] + [1] for i in rng.sample(range(num_seqs), min(512, num_seqs))]
    lookup_us = time_per_op(m.lookup_prefix, probes)
    hit_tokens = sum(m.lookup_prefix(p) for p in probes) / len(probes)
    free_us = time_per_op(m.free, seq_ids)
    return {"append_us_per_seq": append_us, "allocate_us": alloc_us, "free_us": free_us,
            "prefix_lookup_us": lookup_us, "prefix_lookup_mean_hit_tokens": hit_tokens,
            "mean_prompt_tokens": sum(len(p) for p in prompts) / num_seqs}


def bench_memory(lengths, budget_tokens: int, block_size: int, max_model_len: int) -> dict:
    """Admit ShareGPT sequences in order into a fixed KV budget until one does not fit.

    Each admitted sequence reserves its prompt, then grows one slot per reply token, as in
    decoding. The contiguous baseline reserves max_model_len slots per sequence up front.
    """
    m = KVCacheManager(budget_tokens // block_size, block_size, enable_prefix_caching=False,
                       watermark=0.0)
    admitted = real_tokens = 0
    for seq_id, (prompt_len, reply_len) in enumerate(lengths):
        if m.allocate(seq_id, range(prompt_len), prompt_len) is None:
            break
        if not m.can_append_slots(seq_id, reply_len):
            m.free(seq_id)
            break
        for _ in range(reply_len):
            m.append_slots(seq_id, 1)
        admitted += 1
        real_tokens += prompt_len + reply_len
    else:
        raise SystemExit(f"the KV budget of {budget_tokens} tokens held all {len(lengths)} "
                         f"samples; pass a smaller --budget-tokens or more --samples")
    reserved = m.stats().gpu_blocks_used * block_size
    baseline = budget_tokens // max_model_len
    baseline_real = sum(p + r for p, r in lengths[:baseline])
    return {"kv_budget_tokens": budget_tokens, "paged_seqs_admitted": admitted,
            "contiguous_seqs_admitted": baseline,
            "concurrency_ratio_vs_contiguous": admitted / baseline,
            "waste_frac": 1 - real_tokens / reserved,
            "contiguous_waste_frac": 1 - baseline_real / (baseline * max_model_len)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=4000)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--budget-tokens", type=int, default=262_144)
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="of the ShareGPT sample")
    parser.add_argument("--dataset", default=None, help="ShareGPT JSON (default: fetched)")
    bench_record.add_no_store_flag(parser)
    args = parser.parse_args(argv)

    lengths = sharegpt_lengths(args.samples, args.max_model_len, args.seed, args.dataset)
    print(f"ShareGPT: {len(lengths)} first-turn pairs within {args.max_model_len} tokens; mean "
          f"prompt {sum(p for p, _ in lengths) / len(lengths):.0f}, mean reply "
          f"{sum(r for _, r in lengths) / len(lengths):.0f} tokens")
    ops = bench_ops(lengths, args.num_seqs, args.block_size, args.decode_steps)
    print(f"{args.num_seqs} live sequences: append-one-token {ops['append_us_per_seq']:.2f} us/seq"
          f"/step, allocate {ops['allocate_us']:.1f} us, free {ops['free_us']:.1f} us, prefix "
          f"lookup {ops['prefix_lookup_us']:.1f} us "
          f"(mean prompt {ops['mean_prompt_tokens']:.0f} tokens)")
    mem = bench_memory(lengths, args.budget_tokens, args.block_size, args.max_model_len)
    print(f"KV budget {mem['kv_budget_tokens']} tokens: paged admits "
          f"{mem['paged_seqs_admitted']} sequences (waste {mem['waste_frac']:.2%}), contiguous "
          f"{args.max_model_len}-token preallocation admits {mem['contiguous_seqs_admitted']} "
          f"(waste {mem['contiguous_waste_frac']:.2%}): "
          f"{mem['concurrency_ratio_vs_contiguous']:.2f}x")
    result = {**ops, **mem, "num_live_seqs": args.num_seqs, "block_size": args.block_size,
              "max_model_len": args.max_model_len, "num_samples": len(lengths),
              "sharegpt_sample": f"seeded uniform sample of {args.samples} first turns of the "
                                 f"whole file (seed {args.seed})"}
    result = {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}
    bench_record.finish("bench_kvmanager", result, args.no_store, argv)
    return result


if __name__ == "__main__":
    main()
