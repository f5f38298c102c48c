"""Storing a benchmark's result so that it can be reproduced and compared: the JSON object a
script printed last, with the machine, its CPU flags, the commit and the command that made it,
under benchmarks/results/<script>/<UTC time>-<commit>.json (committed with the change it
measures). Results are compared within one machine only: read `machine` before a figure."""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# The flags that decide which kernels run; the full list is long and mostly irrelevant.
KEY_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx512_bf16", "avx_vnni", "amx_bf16", "amx_int8", "amx_tile", "asimd", "sve")


def machine() -> dict:
    flags, model = set(), platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("flags", "Features") and not flags:
                flags = set(value.split())
            elif key == "model name" and model == platform.processor():
                model = value.strip()
    except OSError:
        pass
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count()
    return {"cpu": model, "arch": platform.machine(), "cores": cores,
            "cpu_flags": sorted(flags & set(KEY_FLAGS)), "python": platform.python_version(),
            "memory_gib": _memory_gib()}


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=30).stdout.strip()
    head = git("rev-parse", "--short=12", "HEAD") or "unknown"
    return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def store(script: str, result: dict, argv: list[str] | None = None) -> Path:
    """Write `result` with its provenance; returns the file's path."""
    argv = sys.argv[1:] if argv is None else argv
    now = datetime.datetime.now(datetime.timezone.utc)
    record = {"script": script, "command": " ".join(["python", f"scripts/{script}.py", *argv]),
              "commit": commit(), "time_utc": now.isoformat(timespec="seconds"),
              "machine": machine(), "result": result}
    folder = RESULTS / script
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{now.strftime('%Y%m%dT%H%M%SZ')}-{record['commit']}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def add_no_store_flag(parser) -> None:
    parser.add_argument("--no-store", action="store_true",
                        help="do not write the result under benchmarks/results/")


def finish(script: str, result: dict, no_store: bool, argv: list[str] | None = None) -> None:
    """Store `result` unless `no_store`, then print it as the last line (one JSON object)."""
    if not no_store:
        print(f"stored in {store(script, result, argv)}", flush=True)
    print(json.dumps(result), flush=True)
