"""The newest-versions run: a throwaway venv built from pyproject.toml alone (every dependency at
the newest release resolvable today, torch the CPU build the lock pins), the quick suite run in
it, and the versions it resolved stored beside the result, as a benchmark's is.

    python scripts/check_newest.py                 # quick suite (-m "not slow")
    python scripts/check_newest.py -- -m "not slow" tests/workers   # other pytest arguments

Prints one JSON object last: the suite's counts and time, and each package whose newest version
differs from scripts/lock/. A failure here is a release upstream that breaks us: fix the code (or,
where upstream is at fault, bound the range in pyproject.toml and say why in scripts/lock/README.md),
then refresh the lock with scripts/lock.sh.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import bench_record  # noqa: E402

LOCK = ROOT / "scripts" / "lock" / f"linux-{platform.machine()}.txt"
EXTRA = ROOT / "scripts" / "lock" / f"extra-{platform.machine()}.in"
SUMMARY = re.compile(r"^=*\s*(\d+ \w+(?:, \d+ \w+)*) in ([\d.]+)s", re.M)


def torch_pin() -> str:
    """The CPU torch the lock uses on this machine type (the newest torch on PyPI for x86_64 is
    a CUDA build of several GB)."""
    for line in EXTRA.read_text().splitlines():
        if line.startswith("torch"):
            return line.strip()
    raise SystemExit(f"{EXTRA} names no torch")


def locked_versions() -> dict[str, str]:
    pins = re.findall(r"^([A-Za-z0-9_.\-]+)==([^\s;\\]+)", LOCK.read_text(), re.M)
    return {name.lower().replace("_", "-"): version for name, version in pins}


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    print("$", " ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.run(cmd, **kwargs)


def build_venv(venv: Path) -> float:
    start = time.monotonic()
    run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    run([*pip, "--upgrade", "pip"], check=True)
    run([*pip, torch_pin()], check=True)
    # torch held at the CPU build (an eager upgrade would take the newest, a CUDA build)
    keep = venv.parent / "torch-constraint.txt"
    keep.write_text(torch_pin() + "\n")
    run([*pip, "--upgrade", "--upgrade-strategy", "eager", "-c", str(keep), "-e", f"{ROOT}[dev]"],
        check=True)
    return time.monotonic() - start


def resolved_versions(venv: Path) -> dict[str, str]:
    out = run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format", "json",
               "--exclude-editable"], capture_output=True, text=True, check=True).stdout
    return {p["name"].lower().replace("_", "-"): p["version"] for p in json.loads(out)}


def run_suite(venv: Path, pytest_args: list[str]) -> dict:
    env = dict(os.environ, PATH=f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}",
               VIRTUAL_ENV=str(venv), PYTHONSAFEPATH="1", PAGEDSERVE_SETUP="skip")
    start = time.monotonic()
    done = run([str(venv / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                *pytest_args], cwd=ROOT, env=env, capture_output=True, text=True)
    sys.stderr.write(done.stdout[-6000:] + done.stderr[-3000:])
    counts = {}
    summary = SUMMARY.findall(done.stdout)
    if summary:
        for part in summary[-1][0].split(", "):
            number, _, what = part.partition(" ")
            if number.isdigit():
                counts[what] = int(number)
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", done.stdout, re.M)
    return {"exit_code": done.returncode, "counts": counts, "failed": failed[:50],
            "wall_s": round(time.monotonic() - start, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep-venv", type=Path, help="build the venv here and keep it")
    bench_record.add_no_store_flag(parser)
    parser.add_argument("pytest_args", nargs="*", default=["-m", "not slow"])
    args = parser.parse_args(argv)
    venv_parent = Path(tempfile.mkdtemp(prefix="pagedserve-newest-"))
    venv = args.keep_venv or venv_parent / "venv"
    try:
        setup_s = build_venv(venv)
        newest = resolved_versions(venv)
        suite = run_suite(venv, args.pytest_args)
    finally:
        if args.keep_venv is None:
            shutil.rmtree(venv_parent, ignore_errors=True)
    locked = locked_versions()
    differs = {name: {"newest": version, "lock": locked.get(name)}
               for name, version in sorted(newest.items()) if locked.get(name) != version}
    result = {"passed": suite["exit_code"] == 0, "pytest_args": args.pytest_args,
              "setup_s": round(setup_s, 1), "suite": suite, "versions": newest,
              "differs_from_lock": differs}
    bench_record.finish("check_newest", result, args.no_store)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
