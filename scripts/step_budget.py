"""Where a step's time goes, from a PAGEDSERVE_STEP_TRACE file: the median of each phase over
the steps of one kind (default: decode-only steps of one sequence, the single-stream case).

    PAGEDSERVE_STEP_TRACE=/tmp/trace.jsonl pagedserve ... ; python scripts/step_budget.py /tmp/trace.jsonl

Phases, in order: schedule (the scheduler's plan), send (plan sent until rank 0 has it),
forward (rank 0's model: matmul, attention, other), sample, return (result sent until the
scheduler has it), update (the result applied, tokens handed on), queue (until the
detokenizer takes them), detokenize (text deltas sent to the client). The last line is a JSON
object: {"steps": n, "ahead_steps": m, "phases_ms": {...}, "token_ms": ...}: token_ms is the
median over the steps of each one's sequential phases; for a step planned ahead (overlapped
scheduling) only send, forward and sample, the rest having run while the worker computed.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

SEQUENTIAL = ("schedule_ms", "send_ms", "forward_ms", "sample_ms", "return_ms", "update_ms",
              "queue_ms", "detokenize_ms")
PARTS = ("matmul_ms", "attention_ms", "other_ms")  # of forward_ms
OVERLAPPED = ("send_ms", "forward_ms", "sample_ms")  # a step planned ahead: the rest overlaps


def budget(lines: list[dict], decode_seqs: int = 1) -> dict:
    detok = {d["step"]: d for d in lines if d.get("role") == "detokenizer"}
    steps = [s | detok.get(s["step"], {}) for s in lines if s.get("role") == "scheduler"
             and s["decode_seqs"] == decode_seqs and s["prefill_tokens"] == 0
             and "forward_ms" in s]
    if not steps:
        raise SystemExit(f"no traced decode steps of {decode_seqs} sequence(s) with worker "
                         f"timings in the trace")
    phases = {k: round(statistics.median(s[k] for s in steps if k in s), 3)
              for k in (*SEQUENTIAL, *PARTS, "round_trip_ms") if any(k in s for s in steps)}
    token = round(statistics.median(
        sum(s.get(k, 0.0) for k in (OVERLAPPED if s.get("ahead") else SEQUENTIAL))
        for s in steps), 3)
    return {"steps": len(steps), "ahead_steps": sum(bool(s.get("ahead")) for s in steps),
            "decode_seqs": decode_seqs, "phases_ms": phases, "token_ms": token}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help="the PAGEDSERVE_STEP_TRACE file")
    p.add_argument("--decode-seqs", type=int, default=1,
                   help="summarize decode-only steps of this many sequences")
    args = p.parse_args(argv)
    with open(args.trace, encoding="utf-8") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    result = budget(lines, args.decode_seqs)
    for name, ms in result["phases_ms"].items():
        indent = "    " if name in PARTS else "  "
        print(f"{indent}{name[:-3]:<12} {ms:8.3f} ms", file=sys.stderr)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
