"""Time one Scheduler.schedule() + update() cycle under a steady flow of requests.

--running sequences decode (max_num_seqs = --running) while --waiting requests queue. Each
request's max_tokens is drawn from --min-output..--max-output, so every cycle some sequences
finish and as many waiting ones are admitted with a prefill chunk of their --prompt-len-token
prompt; after each cycle the queue is topped up to --waiting again (outside the timed region,
as AddRequest arrivals are outside schedule() and update()). The sequences present at the start
are staggered (their max_tokens drawn from 1..--max-output) and --warmup cycles run unmeasured,
so the --cycles measured cycles see the flow's steady mix: admissions, prefill chunks, decodes
and finishes, reported per cycle in the JSON.

The workers are replaced by a fake that keeps what a worker keeps (each sequence's tokens not
yet computed) and samples token 7 for every sequence whose step reaches the end of its tokens,
so each result has exactly the rows a real step's would. It runs outside the timed region.

The measured state is not frozen out of the garbage collector: the collections that the live
sequences cause are part of a cycle's cost, as in the scheduler process, which freezes its
start-up state only (pipeline/scheduler/process.py); this script freezes the freshly built
scheduler the same way, before any request. `--gc-freeze` also freezes the requests set up
before measuring (the old behaviour of this script, for comparison). Time spent in collections
during the measured cycles is reported (`gc_ms`, `gc_collections`).

The last line is one JSON object, stored under benchmarks/results/bench_scheduler/
(scripts/bench_record.py) unless --no-store. Target: p50 <= 2 ms.
"""
from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_record  # noqa: E402
from pagedserve.pipeline.messages import StepResult  # noqa: E402
from pagedserve.pipeline.sampling_params import SamplingParams  # noqa: E402
from pagedserve.pipeline.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from pagedserve.pipeline.scheduler.sequence import Request  # noqa: E402

TOKEN = 7  # what the fake workers sample; never an EOS id here


class FakeWorkers:
    """Per sequence, how many of its tokens the workers have not computed yet: a decode has 1
    (its last sampled token), a sequence mid-prefill more."""

    def __init__(self) -> None:
        self.uncomputed: dict[int, int] = {}

    def step(self, plan) -> tuple[StepResult, dict]:
        """The plan's result, and its mix: decodes, prefill chunks and their tokens."""
        uncomputed = self.uncomputed
        for seq_id in plan.finished_seq_ids:
            uncomputed.pop(seq_id, None)
        for new in plan.new_seqs:
            uncomputed[new.seq_id] = (len(new.prompt_token_ids) + len(new.output_token_ids)
                                      - new.num_computed_tokens)
        # Decode columns compute their one token and sample: still one uncomputed after.
        sampled = list(plan.decode_seq_ids)
        decodes, chunks, prefill_tokens = len(sampled), 0, 0
        for s in plan.scheduled:
            before = uncomputed[s.seq_id]
            if before == 1:
                decodes += 1
            else:
                chunks += 1
                prefill_tokens += s.num_tokens
            if before == s.num_tokens:  # reaches the end of its tokens: samples
                sampled.append(s.seq_id)
                uncomputed[s.seq_id] = 1
            else:
                uncomputed[s.seq_id] = before - s.num_tokens
        result = StepResult(plan.step_id, sampled, [TOKEN] * len(sampled), None, None)
        return result, {"decodes": decodes, "prefill_chunks": chunks,
                        "prefill_tokens": prefill_tokens, "admissions": len(plan.new_seqs)}


class GCClock:
    """Time and count the collections that happen while `on` is set."""

    def __init__(self) -> None:
        self.on, self.seconds, self.collections, self._start = False, 0.0, [0, 0, 0], 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if not self.on:
            return
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start
            self.collections[info["generation"]] += 1


def percentiles(samples: list[float]) -> tuple[float, float]:
    samples = sorted(samples)
    return statistics.median(samples), samples[min(len(samples) - 1, int(0.99 * len(samples)))]


class Flow:
    """New requests: distinct prompts (no prefix-cache hits), max_tokens drawn from a range."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.rng, self.count = args, random.Random(args.seed), 0

    def request(self, max_tokens: int | None = None) -> Request:
        a, n = self.args, self.count
        self.count += 1
        if max_tokens is None:
            max_tokens = self.rng.randint(a.min_output, a.max_output)
        prompt = [(n * 31 + j) % 30000 + 3 for j in range(a.prompt_len)]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        return Request(f"r{n}", prompt, params, arrival_time=float(n))


def build(args: argparse.Namespace) -> tuple[Scheduler, FakeWorkers, Flow, float]:
    """The scheduler with --running sequences decoding and --waiting queued; the clock."""
    max_len = args.prompt_len + args.max_output
    blocks_per_seq = -(-max_len // args.block_size)
    config = SchedulerConfig(max_model_len=max_len, block_size=args.block_size,
                             max_num_seqs=args.running,
                             max_num_batched_tokens=max(4096, args.running),
                             max_queued_requests=args.running + args.waiting + 1)
    sched = Scheduler.from_config(config, num_gpu_blocks=blocks_per_seq * args.running + 64,
                                  eos_token_ids=(2,))
    gc.collect()
    gc.freeze()  # the scheduler process's start-up state, frozen as that process does
    workers, flow = FakeWorkers(), Flow(args)
    for _ in range(args.running):  # staggered: as if each were part-way through its output
        sched.add(flow.request(flow.rng.randint(1, args.max_output)))
    now = 0.0
    while sched.num_waiting:  # prefill everyone
        plan = sched.schedule(now)
        sched.update(plan, workers.step(plan)[0], now)
        now += 1
    return sched, workers, flow, now


def run(args: argparse.Namespace) -> dict:
    sched, workers, flow, now = build(args)
    for _ in range(args.waiting):
        sched.add(flow.request())
    clock = GCClock()
    gc.callbacks.append(clock)
    if args.gc_freeze:
        gc.collect()
        gc.freeze()
    times, cpu_times, mixes, finishes = [], [], [], []
    try:
        for cycle in range(args.warmup + args.cycles):
            measured = cycle >= args.warmup
            clock.on = measured
            c0, t0 = time.thread_time(), time.perf_counter()
            plan = sched.schedule(now)
            c1, t1 = time.thread_time(), time.perf_counter()
            clock.on = False
            result, mix = workers.step(plan)
            clock.on = measured
            c2, t2 = time.thread_time(), time.perf_counter()
            outputs = sched.update(plan, result, now)
            c3, t3 = time.thread_time(), time.perf_counter()
            clock.on = False
            now += 1
            while sched.num_waiting < args.waiting:
                sched.add(flow.request())
            if measured:
                times.append((t1 - t0 + t3 - t2) * 1e3)
                cpu_times.append((c1 - c0 + c3 - c2) * 1e3)
                mixes.append(mix)
                finishes.append(sum(1 for o in outputs.others if o.finish_reason))
    finally:
        gc.callbacks.remove(clock)
        gc.unfreeze()
    return summarize(args, times, cpu_times, mixes, finishes, sched, clock)


def summarize(args, times, cpu_times, mixes, finishes, sched, clock) -> dict:
    p50, p99 = percentiles(times)
    cpu_p50, cpu_p99 = percentiles(cpu_times)
    cycles = len(times)

    def per_cycle(key: str) -> float:
        return round(sum(m[key] for m in mixes) / cycles, 2)

    return {"cycle_ms_p50": round(p50, 4), "cycle_ms_p99": round(p99, 4),
            "cycle_cpu_ms_p50": round(cpu_p50, 4), "cycle_cpu_ms_p99": round(cpu_p99, 4),
            "running": args.running, "waiting": args.waiting, "cycles": args.cycles,
            "warmup": args.warmup, "prompt_len": args.prompt_len,
            "output_range": [args.min_output, args.max_output], "gc_freeze": args.gc_freeze,
            "decodes_per_cycle": per_cycle("decodes"),
            "admissions_per_cycle": per_cycle("admissions"),
            "prefill_chunks_per_cycle": per_cycle("prefill_chunks"),
            "prefill_tokens_per_cycle": per_cycle("prefill_tokens"),
            "finishes_per_cycle": round(sum(finishes) / cycles, 2),
            "admissions": sum(m["admissions"] for m in mixes), "finishes": sum(finishes),
            "preemptions": sched.num_preemptions, "gc_ms": round(clock.seconds * 1e3, 3),
            "gc_collections": clock.collections}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--running", type=int, default=2048, help="sequences running (max_num_seqs)")
    ap.add_argument("--waiting", type=int, default=2000,
                    help="requests queued, topped up after every cycle")
    ap.add_argument("--cycles", type=int, default=300, help="measured cycles")
    ap.add_argument("--warmup", type=int, default=50, help="unmeasured cycles before them")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--min-output", type=int, default=32, help="max_tokens of a new request: "
                    "uniform in --min-output..--max-output")
    ap.add_argument("--max-output", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gc-freeze", action="store_true",
                    help="also freeze the set-up requests out of the GC (the old measurement)")
    bench_record.add_no_store_flag(ap)
    return ap


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if not 1 <= args.min_output <= args.max_output:
        raise SystemExit(f"need 1 <= --min-output ({args.min_output}) <= --max-output "
                         f"({args.max_output})")
    result = run(args)
    print(f"{args.running} running, {args.waiting} waiting, {args.cycles} cycles: "
          f"schedule+update wall p50 {result['cycle_ms_p50']:.3f} ms, p99 "
          f"{result['cycle_ms_p99']:.3f} ms; CPU p50 {result['cycle_cpu_ms_p50']:.3f} ms; per "
          f"cycle {result['decodes_per_cycle']} decodes, {result['admissions_per_cycle']} "
          f"admissions ({result['prefill_tokens_per_cycle']} prefill tokens), "
          f"{result['finishes_per_cycle']} finishes; GC {result['gc_ms']:.1f} ms in "
          f"{result['gc_collections']} collections (gen 0/1/2)")
    bench_record.finish("bench_scheduler", result, args.no_store, argv)
    return result


if __name__ == "__main__":
    main()
