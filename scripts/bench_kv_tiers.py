"""KV tiers (issue 42): time to first token with the host and disk tiers on against off.

1. Multi-turn ShareGPT conversations, the conversations taking turns and each turn resending
   its conversation so far (the dataset's replies), one request at a time, against a device
   pool too small to keep them all: TTFT p50 and the prefill tokens computed, tiers off
   against on (--kv-offload-memory and --kv-offload-dir).
2. One shared prefix of --prefix-tokens tokens after a restart: an engine computes it (and
   writes it to the disk tier), a new engine - every process of the group anew, in process -
   answers another prompt on that prefix, cold (no tiers) against loading it from disk.

Engines run in this process (pipeline/engine_core.py: the scheduler and one worker rank, the
same code as the process group). Prints one JSON object last, stored under
benchmarks/results/bench_kv_tiers/ (scripts/bench_record.py) unless --no-store.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_record  # noqa: E402
import sharegpt  # noqa: E402

from pagedserve.pipeline import messages  # noqa: E402
from pagedserve.pipeline.config import EngineConfig  # noqa: E402
from pagedserve.pipeline.engine_core import EngineCore  # noqa: E402
from pagedserve.pipeline.sampling_params import SamplingParams  # noqa: E402

PARAMS = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0)


def conversations(tokenizer, num: int, turns: int, max_tokens: int, path) -> list[list[list[int]]]:
    """Per conversation, its prompts turn by turn (each within max_tokens)."""
    convs = []
    for entry in sharegpt.iter_entries(path):
        msgs = [t.get("value") or "" for t in entry.get("conversations") or []]
        if len(msgs) < 2 * turns or not all(m.strip() for m in msgs[:2 * turns]):
            continue
        prompts, text = [], ""
        for t in range(turns):
            text += f"User: {msgs[2 * t]}\nAssistant:"
            prompts.append(tokenizer.encode(text))
            text += f" {msgs[2 * t + 1]}\n"
        if len(prompts[-1]) > max_tokens or len(prompts[0]) < 64:
            continue
        convs.append(prompts)
        if len(convs) == num:
            break
    return convs


def engine(args, kv_cache_memory=None, **tiers) -> EngineCore:
    return EngineCore.build(EngineConfig.from_kwargs(
        model=args.model, kv_cache_memory=kv_cache_memory or args.kv_cache_memory,
        max_model_len=8192,
        swap_space=0.0, max_num_seqs=4, **tiers))


def ttft(core: EngineCore, prompt: list[int], rid: str) -> float:
    """Seconds from submitting `prompt` alone to its first token; runs it to its end."""
    started = time.perf_counter()
    core.submit(messages.AddRequest(request_id=rid, prompt_token_ids=prompt, sampling=PARAMS,
                                    arrival_time=time.time()))
    first = None
    while core.has_unfinished():
        msgs = core.step(time.time())
        if first is None and any(d.token_ids for m in msgs for d in m.deltas):
            first = time.perf_counter() - started
    return first


def multi_turn(args, convs, **tiers) -> dict:
    core = engine(args, **tiers)
    ttft(core, list(range(100, 140)), "warm")
    before = core.stats()
    times = [ttft(core, conv[t], f"c{c}t{t}") for t in range(args.turns)
             for c, conv in enumerate(convs)]
    stats = core.stats()
    computed = (stats["prefix_cache_queries"] - before["prefix_cache_queries"]) - (
        stats["prefix_cache_hits"] - before["prefix_cache_hits"])
    out = {"ttft_p50_s": statistics.median(times), "ttft_mean_s": statistics.fmean(times),
           "prefill_tokens_computed": computed, "requests": len(times),
           "kv_blocks_total": stats["kv_blocks_total"]}
    out |= {k: v for k, v in stats.items() if k.startswith("kv_host") or k.startswith("kv_disk")}
    _close(core)
    return out


def _close(core: EngineCore) -> None:
    tiers = core.worker.tiers
    if tiers is not None:
        tiers.close(60.0)


def restart(args, prefix: list[int], disk_dir: str) -> dict:
    big = args.restart_kv_cache_memory
    first = engine(args, big, kv_offload_dir=disk_dir)
    ttft(first, prefix + [5, 6, 7, 8], "compute")
    _close(first)  # every block written before the "restart"
    del first
    out = {}
    for name, tiers in (("cold", {}), ("disk", {"kv_offload_dir": disk_dir})):
        core = engine(args, big, **tiers)
        ttft(core, list(range(100, 140)), "warm")
        out[f"{name}_ttft_s"] = ttft(core, prefix + [9, 10, 11, 12], "again")
        if tiers:
            out["disk_hit_tokens"] = core.stats()["kv_disk_hit_tokens"]
        _close(core)
        del core
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--kv-cache-memory", default="40MiB",
                        help="the multi-turn run's device pool: smaller than the conversations")
    parser.add_argument("--restart-kv-cache-memory", default="160MiB",
                        help="the restart run's device pool: room for the prefix")
    parser.add_argument("--kv-offload-memory", default="2GiB")
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-prompt-tokens", type=int, default=1200)
    parser.add_argument("--prefix-tokens", type=int, default=4000)
    parser.add_argument("--dataset", default=None, help="ShareGPT JSON (default: fetched)")
    bench_record.add_no_store_flag(parser)
    args = parser.parse_args(argv)

    probe = engine(args)
    tokenizer = probe.detokenizer.tokenizer
    del probe
    convs = conversations(tokenizer, args.conversations, args.turns, args.max_prompt_tokens,
                          args.dataset)
    scratch = tempfile.mkdtemp(prefix="bench-kv-tiers-")
    try:
        off = multi_turn(args, convs)
        on = multi_turn(args, convs, kv_offload_memory=args.kv_offload_memory,
                        kv_offload_dir=str(Path(scratch) / "multi"))
        text = " ".join(p for p, _ in sharegpt.first_turns(args.dataset, limit=200))
        prefix = tokenizer.encode(text)[:args.prefix_tokens]
        rs = restart(args, prefix, str(Path(scratch) / "restart"))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result = {
        "model": args.model, "kv_cache_memory": args.kv_cache_memory,
        "restart_kv_cache_memory": args.restart_kv_cache_memory,
        "kv_offload_memory": args.kv_offload_memory,
        "multi_turn": {"conversations": len(convs), "turns": args.turns, "off": off, "on": on,
                       "ttft_p50_speedup": off["ttft_p50_s"] / on["ttft_p50_s"],
                       "prefill_tokens_ratio": off["prefill_tokens_computed"]
                       / max(1, on["prefill_tokens_computed"])},
        "restart": {"prefix_tokens": len(prefix), **rs,
                    "ttft_speedup": rs["cold_ttft_s"] / rs["disk_ttft_s"]},
    }
    print(f"multi-turn TTFT p50 off {off['ttft_p50_s']:.3f}s on {on['ttft_p50_s']:.3f}s "
          f"({result['multi_turn']['ttft_p50_speedup']:.2f}x); prefill tokens "
          f"{off['prefill_tokens_computed']} -> {on['prefill_tokens_computed']}")
    print(f"restart, {len(prefix)}-token prefix: cold {rs['cold_ttft_s']:.3f}s, disk "
          f"{rs['disk_ttft_s']:.3f}s ({result['restart']['ttft_speedup']:.2f}x)")
    bench_record.finish("bench_kv_tiers", result, args.no_store, argv)
    return result


if __name__ == "__main__":
    main()
