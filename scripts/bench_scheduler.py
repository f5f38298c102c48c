"""Time one schedule() + update() cycle with 2,048 running sequences and 2,000 waiting.

The workers are replaced by a StepResult built outside the timed region (one token per sampling
sequence). Target: p50 <= 2 ms. The last line printed is one JSON object.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time


from pagedserve.pipeline.messages import StepResult  # noqa: E402
from pagedserve.pipeline.sampling_params import SamplingParams  # noqa: E402
from pagedserve.pipeline.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from pagedserve.pipeline.scheduler.sequence import Request  # noqa: E402


def fake_result(plan) -> StepResult:
    """A token for every scheduled sequence that reaches the end of its tokens (all decodes),
    in plan order: the decode columns, then `scheduled`."""
    seq_ids = plan.decode_seq_ids + [s.seq_id for s in plan.scheduled]
    return StepResult(plan.step_id, seq_ids, [7] * len(seq_ids), None, None)


def percentiles(samples: list[float]) -> tuple[float, float]:
    samples = sorted(samples)
    return statistics.median(samples), samples[min(len(samples) - 1, int(0.99 * len(samples)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--running", type=int, default=2048)
    ap.add_argument("--waiting", type=int, default=2000)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--cycles", type=int, default=300)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--no-store", action="store_true",
                    help="do not write the result under benchmarks/results/")
    args = ap.parse_args()

    max_tokens = args.cycles + 64  # nobody finishes while we measure
    max_len = args.prompt_len + max_tokens
    blocks_per_seq = -(-max_len // args.block_size)
    config = SchedulerConfig(max_model_len=max_len, block_size=args.block_size,
                             max_num_seqs=args.running,
                             max_num_batched_tokens=max(4096, args.running),
                             max_queued_requests=args.running + args.waiting)
    sched = Scheduler.from_config(config, num_gpu_blocks=blocks_per_seq * args.running + 64,
                                  eos_token_ids=(2,))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i in range(args.running):
        prompt = [(i * 31 + j) % 30000 + 3 for j in range(args.prompt_len)]
        sched.add(Request(f"r{i}", prompt, params, arrival_time=float(i)))
    now = 0.0
    while sched.num_waiting:  # prefill everyone
        plan = sched.schedule(now)
        sched.update(plan, fake_result(plan), now)
        now += 1
    for i in range(args.waiting):
        sched.add(Request(f"w{i}", [5] * args.prompt_len, params, arrival_time=1e6 + i))
    assert sched.num_running == args.running and sched.num_waiting == args.waiting

    times, cpu_times = [], []
    gc.collect()
    # Long-lived start-up state is not rescanned, as in a scheduler that has run for a while
    # (its state sits in the oldest generation); the scheduler process freezes its start-up
    # state the same way.
    gc.freeze()
    for _ in range(args.cycles):
        c0, t0 = time.thread_time(), time.perf_counter()
        plan = sched.schedule(now)
        c1, t1 = time.thread_time(), time.perf_counter()
        result = fake_result(plan)
        c2, t2 = time.thread_time(), time.perf_counter()
        sched.update(plan, result, now)
        c3, t3 = time.thread_time(), time.perf_counter()
        times.append((t1 - t0 + t3 - t2) * 1e3)
        cpu_times.append((c1 - c0 + c3 - c2) * 1e3)
        now += 1
        assert plan.num_scheduled == args.running
    p50, p99 = percentiles(times)
    cpu_p50, cpu_p99 = percentiles(cpu_times)
    print(f"{args.running} running, {args.waiting} waiting, {args.cycles} cycles: "
          f"schedule+update wall p50 {p50:.3f} ms, p99 {p99:.3f} ms; "
          f"CPU p50 {cpu_p50:.3f} ms, p99 {cpu_p99:.3f} ms "
          f"({cpu_p50 * 1e3 / args.running:.2f} us CPU per sequence)")
    result = {"cycle_ms_p50": round(p50, 4), "cycle_ms_p99": round(p99, 4),
              "cycle_cpu_ms_p50": round(cpu_p50, 4), "cycle_cpu_ms_p99": round(cpu_p99, 4),
              "running": args.running, "waiting": args.waiting, "cycles": args.cycles}
    if not args.no_store:
        import bench_record
        print(f"stored in {bench_record.store('bench_scheduler', result)}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
