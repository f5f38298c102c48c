"""Two commits of pagedserve served end to end on this machine, alternated: which is faster.

Each revision is checked out into its own git worktree (under --workdir, kept for reuse) and
imported from there: a folder holding a `pagedserve` package built of the worktree's
`pagedserve/` files and links to its `kernels/ kvmanager/ pipeline/ workers/` goes first on
PYTHONPATH (children inherit it), ahead of this checkout's editable install. The venv, the model
cache and the native kernel cache (keyed by source) are shared. For each of `--pairs` rounds,
each revision's server is started alone, scripts/bench_serving.py (this checkout's) runs against
it with the same arguments, and the server is stopped; the order alternates round by round, so
drift on a shared host falls on both.

    .venv/bin/python scripts/ab_commits.py 55e2e12 475526d                  # 64 streams
    .venv/bin/python scripts/ab_commits.py 55e2e12 475526d --single-stream --pairs 3

The last line is one JSON object (each run, the medians per revision, B / A ratios), stored
under benchmarks/results/ab_commits/.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_record  # noqa: E402
from compare_llama_server import (FIGURES, ROOT, Server, bench_arguments, log,  # noqa: E402
                                  median, run_bench_serving)
from pagedserve.workers.builtin_models import DEFAULT_MODEL  # noqa: E402

PACKAGES = ("kernels", "kvmanager", "pipeline", "workers")


def resolve(rev: str) -> str:
    return subprocess.run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=ROOT,
                          check=True, capture_output=True, text=True).stdout.strip()


def import_root(commit: str, workdir: Path) -> Path:
    """A folder whose `pagedserve` package is `commit`'s code (its worktree made once)."""
    tree = workdir / commit[:12]
    if not (tree / ".git").exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), commit], cwd=ROOT,
                       check=True, capture_output=True)
    root = tree / ".ab-import"
    package = root / "pagedserve"
    if not package.exists():
        package.mkdir(parents=True)
        for entry in (tree / "pagedserve").iterdir():
            (package / entry.name).symlink_to(entry)
        for name in PACKAGES:
            (package / name).symlink_to(tree / name)
    return root


def check_import(name: str, root: Path, tree: Path) -> None:
    """The server will run `root`'s code, not this checkout's."""
    probe = "import pagedserve.pipeline as p; print(p.__file__)"
    where = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(root), "PYTHONSAFEPATH": "1"},
                           cwd=tempfile.gettempdir()).stdout.strip()
    if not Path(where).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"{name}: pagedserve.pipeline imports from {where!r}, not {tree}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("rev_a", help="the baseline revision")
    p.add_argument("rev_b", help="the revision compared with it")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--single-stream", action="store_true",
                   help="one request at a time: --max-concurrency 1 --num-prompts 6")
    p.add_argument("--num-prompts", type=int, help="default 64 (6 single-stream)")
    p.add_argument("--max-concurrency", type=int, help="default 64 (1 single-stream)")
    p.add_argument("--max-output-tokens", type=int, default=256)
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-args", default="", help="more flags for both servers")
    p.add_argument("--isa", choices=("native", "avx2"), default="native",
                   help="avx2: both with PAGEDSERVE_NATIVE_VARIANT=avx2")
    p.add_argument("--port", type=int, default=8093)
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument("--workdir", type=Path,
                   default=Path(tempfile.gettempdir()) / "pagedserve-ab-commits")
    # what compare_llama_server's bench_arguments reads besides: the same workload as there
    p.set_defaults(request_rate="inf", gguf=None)
    bench_record.add_no_store_flag(p)
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="ab-commits-"))
    env = {"PAGEDSERVE_NATIVE_VARIANT": "avx2"} if args.isa == "avx2" else {}
    sides = []
    for label, rev in (("a", args.rev_a), ("b", args.rev_b)):
        commit = resolve(rev)
        root = import_root(commit, args.workdir)
        check_import(label, root, args.workdir / commit[:12])
        cmd = [sys.executable, "-m", "pagedserve.pipeline.launch", "--model", args.model,
               "--host", "127.0.0.1", "--port", str(args.port), *shlex.split(args.server_args)]
        server = Server(f"{label}-{commit[:12]}", cmd, args.port, logs / f"{label}.log",
                        {**env, "PYTHONPATH": str(root), "PYTHONSAFEPATH": "1"})
        sides.append((label, commit, server))
    bench_args = bench_arguments(args)
    runs: dict[str, list[dict]] = {"a": [], "b": []}
    for round_ in range(args.pairs):
        for label, _commit, server in (sides if round_ % 2 == 0 else sides[::-1]):
            try:
                server.start(args.start_timeout)
                result = run_bench_serving(server, bench_args, logs / f"{label}-{round_}.json")
            finally:
                server.stop()
            runs[label].append({"round": round_, **result})
            log(f"round {round_} {server.name}: {result['output_tok_s']} output tok/s, "
                f"TTFT p50 {result['ttft_ms_p50']} ms, TPOT p50 {result['tpot_ms_p50']} ms")
    medians = {label: {k: median([r[k] for r in rs]) for k in FIGURES}
               for label, rs in runs.items()}
    ratios = {k: round(medians["b"][k] / medians["a"][k], 3) if medians["a"][k] else None
              for k in ("output_tok_s", "ttft_ms_p50", "tpot_ms_p50", "itl_ms_p50")}
    ratios["output_tok_s_per_pair"] = [round(b["output_tok_s"] / a["output_tok_s"], 3)
                                       for a, b in zip(runs["a"], runs["b"])]
    report = {"mode": "single-stream" if args.single_stream else "concurrent",
              "isa": args.isa, "model": args.model, "pairs": args.pairs,
              "bench_serving_args": bench_args, "logs": str(logs),
              "a": {"commit": sides[0][1], "command": shlex.join(sides[0][2].cmd),
                    "runs": runs["a"]},
              "b": {"commit": sides[1][1], "command": shlex.join(sides[1][2].cmd),
                    "runs": runs["b"]},
              "median": medians, "ratios_b_over_a": ratios}
    print(f"b / a over {args.pairs} pairs (medians): output tok/s {ratios['output_tok_s']}x "
          f"(per pair {ratios['output_tok_s_per_pair']}), TTFT p50 {ratios['ttft_ms_p50']}x, "
          f"TPOT p50 {ratios['tpot_ms_p50']}x", file=sys.stderr)
    bench_record.finish("ab_commits", report, args.no_store, argv)
    return report


if __name__ == "__main__":
    main()
