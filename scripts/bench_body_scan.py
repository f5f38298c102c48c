"""Cost per byte of reading a request body (pipeline/ingress/json_body.py) on crafted bodies:
what a hostile client would send to make the ingress spend more than linear time.

Each shape is built at each size (default 10 KB, 100 KB, 1 MB) and decoded --repeat times; the
fastest run counts. A shape whose run takes longer than --cap-s is not tried at larger sizes
(the quadratic scan of an unterminated escaped string took 8 s at 40 KB). Prints one line per
measurement; the last line is one JSON object (worst seconds per byte over all shapes and sizes,
and per shape the growth of seconds per byte from its smallest to its largest size: ~1 when
linear), stored under benchmarks/results/bench_body_scan/ (scripts/bench_record.py) unless
--no-store.

    python scripts/bench_body_scan.py [--sizes 10000,100000,1000000] [--repeat 3] [--no-store]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_record  # noqa: E402
from pagedserve.pipeline.ingress.errors import APIError  # noqa: E402
from pagedserve.pipeline.ingress.json_body import decode_json_object  # noqa: E402

# More brackets than the depth limit (so that the nesting scan runs), nested only 2 deep.
OPEN = b'{"a":[' + b"[]," * 70


def _fill(head: bytes, unit: bytes, tail: bytes, size: int) -> bytes:
    return head + unit * max(0, (size - len(head) - len(tail)) // len(unit)) + tail


# name -> body of about `size` bytes
SHAPES = {
    # an unterminated string of escaped quotes: each quote began a new scan to the end
    "escaped_quotes": lambda n: _fill(OPEN + b'"', b'\\"', b"", n),
    "escaped_backslashes": lambda n: _fill(OPEN + b'"', b"\\\\", b"", n),
    "empty_strings": lambda n: _fill(OPEN, b'"",', b'""]}', n),
    "unterminated_string": lambda n: _fill(OPEN + b'"', b"a[", b"", n),
    "deep_nesting": lambda n: _fill(b"", b"[", b"", n // 2) + b"]" * (n // 2),
    "long_string": lambda n: _fill(OPEN + b'"', b"x", b'"]}', n),
    "many_brackets": lambda n: _fill(b'{"a":[', b"[],", b"[]]}", n),
    "many_objects": lambda n: _fill(b'{"a":[', b'{"k":[1]},', b"{}]}", n),
    "surrogate_escapes": lambda n: _fill(b'{"a":["', b"\\ud800", b'"]}', n),
    # a lone surrogate found by a walk that built each item's path: a long key was copied
    # once per item beneath it
    "surrogate_long_key": lambda n: _fill(b'{"x":"\\ud800","' + b"k" * (n // 2) + b'":[',
                                          b"0,", b"0]}", n),
}


def decode_seconds(body: bytes, repeat: int) -> tuple[float, str]:
    """(fastest decode of `body` in seconds, "accepted" or the start of the 400's message)."""
    best, outcome = float("inf"), ""
    for _ in range(repeat):
        start = time.perf_counter()
        try:
            decode_json_object(body)
            outcome = "accepted"
        except APIError as exc:
            outcome = "400: " + exc.message[:48]
        best = min(best, time.perf_counter() - start)
    return best, outcome


def run(sizes: list[int], repeat: int, cap_s: float) -> dict:
    shapes: dict[str, dict] = {}
    worst = (0.0, "", 0)
    for name, make in SHAPES.items():
        rows = []
        for size in sizes:
            body = make(size)
            seconds, outcome = decode_seconds(body, repeat)
            per_byte = seconds / len(body)
            rows.append({"bytes": len(body), "seconds": round(seconds, 6),
                         "ns_per_byte": round(per_byte * 1e9, 2), "outcome": outcome})
            print(f"{name:20s} {len(body):>9d} B  {seconds:9.4f} s  {per_byte * 1e9:9.2f} ns/B  "
                  f"{outcome}", flush=True)
            worst = max(worst, (per_byte, name, len(body)))
            if seconds > cap_s:
                print(f"{name:20s} larger sizes skipped (over --cap-s {cap_s:g})", flush=True)
                break
        growth = rows[-1]["ns_per_byte"] / max(rows[0]["ns_per_byte"], 1e-9)
        shapes[name] = {"sizes": rows, "growth": round(growth, 2),
                        "complete": len(rows) == len(sizes)}
    return {"worst_s_per_byte": worst[0], "worst_shape": worst[1], "worst_bytes": worst[2],
            "max_growth": max(s["growth"] for s in shapes.values()),
            "sizes": sizes, "repeat": repeat, "shapes": shapes}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10000,100000,1000000",
                        help="comma-separated body sizes in bytes")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cap-s", type=float, default=5.0,
                        help="skip a shape's larger sizes once one decode takes this long")
    bench_record.add_no_store_flag(parser)
    args = parser.parse_args(argv)
    sizes = sorted(int(s) for s in args.sizes.split(","))
    bench_record.finish("bench_body_scan", run(sizes, args.repeat, args.cap_s), args.no_store,
                        argv)


if __name__ == "__main__":
    main()
