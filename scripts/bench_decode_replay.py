"""Decode step time with the CPU decode replay (workers/cpu_decode_replay.py) against the eager
forward, in one process, alternating.

For each batch size every sequence owns its blocks and recomputes the token at position
context - 1 (the same work every step); a step is the runner's whole `execute` (flattening, the
forward, the LM head; sampling excluded). Each round times `--steps` steps replayed, then the same
eager (the order swaps every round), so both see the same host; the report gives each way's
median over rounds and their ratio, and checks that both ways give the same logits bits.
The last line is one JSON object, stored under benchmarks/results/bench_decode_replay/
(scripts/bench_record.py) unless --no-store.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_record  # noqa: E402

from pagedserve.workers.loader import TEST_MODEL, load_config, resolve_model  # noqa: E402
from pagedserve.workers.model_runner import ModelRunner, SeqStep  # noqa: E402


def step_ms(runner: ModelRunner, items: list[SeqStep], steps: int) -> float:
    started = time.perf_counter()
    for _ in range(steps):
        runner.execute(items)
    return (time.perf_counter() - started) / steps * 1e3


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=TEST_MODEL)
    parser.add_argument("--quantization", default="auto",
                        help="auto (a GGUF stays in its blocks), none, int8")
    parser.add_argument("--batch-sizes", default="1,2,4,8,16")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=40, help="steps per timed run")
    parser.add_argument("--rounds", type=int, default=6, help="alternations of the two ways")
    parser.add_argument("--threads", type=int, default=None)
    bench_record.add_no_store_flag(parser)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    model_dir = resolve_model(args.model)
    block = 16
    per_seq = -(-args.context // block)
    runner = ModelRunner(load_config(model_dir), model_dir, torch.float32, "cpu", block,
                         max(batches) * per_seq, quantization=args.quantization)
    replay = runner.cpu_replay
    if replay is None:
        raise SystemExit("this model and settings do not replay (see the runner's log line)")
    vocab = runner.config.vocab_size
    results = []
    for batch in batches:
        items = [SeqStep([(17 * b + 5) % vocab], args.context - 1,
                         list(range(b * per_seq, (b + 1) * per_seq)), True) for b in range(batch)]
        times = {"replay": [], "eager": []}
        logits = {}
        for way in ("replay", "eager"):       # warm-up (and recording), and the bits compared
            runner.cpu_replay = replay if way == "replay" else None
            logits[way] = runner.execute(items).clone()
            step_ms(runner, items, 3)
        for r in range(args.rounds):
            for way in (("replay", "eager") if r % 2 == 0 else ("eager", "replay")):
                runner.cpu_replay = replay if way == "replay" else None
                times[way].append(step_ms(runner, items, args.steps))
        runner.cpu_replay = replay
        replayed, eager = statistics.median(times["replay"]), statistics.median(times["eager"])
        row = {"batch": batch, "replay_ms": round(replayed, 3), "eager_ms": round(eager, 3),
               "speedup": round(eager / replayed, 3),
               "same_logits": bool(torch.equal(logits["replay"], logits["eager"])),
               "replay_runs_ms": [round(t, 3) for t in times["replay"]],
               "eager_runs_ms": [round(t, 3) for t in times["eager"]]}
        print(f"batch {batch:3d}: replay {replayed:7.2f} ms  eager {eager:7.2f} ms  "
              f"x{eager / replayed:.2f}  same logits {row['same_logits']}", file=sys.stderr)
        results.append(row)
    report = {"model": args.model, "quantization": runner.quantization,
              "context": args.context, "threads": torch.get_num_threads(),
              "steps": args.steps, "rounds": args.rounds, "batches": results}
    bench_record.finish("bench_decode_replay", report, args.no_store, argv)
    return report


if __name__ == "__main__":
    main()
