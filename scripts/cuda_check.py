"""Checks and timings on a CUDA GPU, in one run (CI has no GPU; run this by hand on a lent one).

    python scripts/cuda_check.py --model-files DIR [--sharegpt FILE] [--out DIR]

Sections, each independent (a failing one prints its traceback and the next still runs):
1. kernels: the Triton kernel tests (tests/kernels), compiled for this GPU, against the torch
   references.
   native: the native CPU kernel tests (tests/kernels/test_native_*.py) in every build variant
   this host's CPU runs, with the counts of passed, failed and skipped tests and why variants
   were skipped: a GPU box's CPU usually has AVX-512, which CI's may lack, so the AVX-512 bodies
   get run here.
2. greedy: a random-weight Llama with SmolLM2's head layout (9 query / 3 kv heads of 64) served by
   our WorkerCore on the GPU in fp32, prompts fed in chunks of 7 with shuffled block tables, all 8
   batched every step, must give transformers' own greedy tokens (transformers on the CPU). The
   same run in bf16 reports how many tokens agree (how many tokens come before each sequence's
   first disagreement: bf16 rounding may flip near-ties).
3. attention: triton.testing.do_bench medians of the decode and prefill kernels at SmolLM2 shapes,
   with the bytes each must read and the bandwidth that gives.
4. bench_step: scripts/bench_step.py --device cuda with random weights of SmolLM2's shapes.
5. throughput: scripts/bench_throughput.py on the GPU over random weights of SmolLM2's shapes
   (DIR must hold config.json and the tokenizer files; the weights are drawn here).

The last line is one JSON object with every section's figures.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "tests" / "workers")]
# Last, for a GPU box given only the source tree: an installed package of any of the root's
# folder names (Hugging Face's kernels) comes first, and importing pagedserve drops it again.
sys.path.append(str(ROOT))
report: dict = {}


def section(name):
    def wrap(fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            print(f"\n=== {name} ===", flush=True)
            try:
                fn(*args, **kwargs)
            except Exception:
                traceback.print_exc()
                report[f"{name}_error"] = traceback.format_exc().strip().splitlines()[-1]
            report[f"{name}_s"] = round(time.perf_counter() - start, 1)
            sys.stdout.flush()
        return run
    return wrap


def last_json(stdout: str) -> dict:
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {}


@section("kernels")
def kernel_tests(out: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
         "tests/kernels/test_kernel_triton.py", "tests/kernels/test_kernel_reference.py",
         "tests/kernels/test_kv_format.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=240)
    (out / "kernel_tests.log").write_text(proc.stdout + proc.stderr)
    tail = proc.stdout.strip().splitlines()[-15:]
    print("\n".join(tail))
    report["kernel_tests_rc"] = proc.returncode
    report["kernel_tests"] = tail[-1] if tail else proc.stderr[-300:]


def pytest_counts(stdout: str) -> dict[str, int]:
    """{outcome: count} from pytest's summary line ("3 failed, 1025 passed, 12 skipped in")."""
    for line in reversed(stdout.strip().splitlines()):
        counts = re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)\b", line)
        if counts and re.search(r" in [\d.]+s", line):
            return {outcome.rstrip("s") if outcome.startswith("error") else outcome: int(n)
                    for n, outcome in counts}
    return {}


@section("native")
def native_tests(out: Path) -> None:
    from pagedserve.kernels import native

    report["native_variants"] = {name: native.variant_unavailable_reason(name) or "available"
                                 for name in native.VARIANTS}
    files = sorted(str(path.relative_to(ROOT))
                   for path in ROOT.glob("tests/kernels/test_native_*.py"))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-o", "addopts=",
         *files], cwd=ROOT, capture_output=True, text=True, timeout=900)
    (out / "native_tests.log").write_text(proc.stdout + proc.stderr)
    counts = pytest_counts(proc.stdout)
    print("\n".join(proc.stdout.strip().splitlines()[-15:]))
    report["native_tests_rc"] = proc.returncode
    for outcome in ("passed", "failed", "skipped", "error"):
        report[f"native_tests_{outcome}"] = counts.get(outcome, 0)
    # the reasons variants were skipped for (SKIPPED [count] file:line: reason)
    report["native_tests_skip_reasons"] = sorted({
        line.split(": ", 1)[1] for line in proc.stdout.splitlines()
        if line.startswith("SKIPPED") and ": " in line})


@section("greedy")
def greedy_check() -> None:
    import numpy as np
    from test_worker_core import BLOCK_SIZE, run_greedy

    from pagedserve.workers.loader import load_config
    from pagedserve.workers.model_runner import ModelRunner
    from pagedserve.workers.sampler import Sampler
    from pagedserve.workers.testing import hf_greedy, make_tiny_llama
    from pagedserve.workers.core import WorkerCore

    model_dir = make_tiny_llama(Path(tempfile.mkdtemp()), seed=3, num_layers=4, hidden_size=576,
                                num_heads=9, num_kv_heads=3, intermediate_size=1536,
                                vocab_size=2048)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 2048, n).tolist() for n in (5, 12, 30, 3, 47, 64, 17, 90)]
    expected = hf_greedy(model_dir, prompts, 32)
    num_blocks = 8 * 9 + 13
    for dtype, graphs in ((torch.float32, True), (torch.float32, False), (torch.bfloat16, True)):
        runner = ModelRunner(load_config(model_dir), model_dir, dtype, "cuda", BLOCK_SIZE,
                             num_blocks, cuda_graph_batch=8 if graphs else 0)
        core = WorkerCore(runner, Sampler(seed=0), 0)
        ours = run_greedy(core.execute, prompts, 32, chunk=7, num_blocks=num_blocks, seed=11)
        # tokens before each sequence's first disagreement (after one, the contexts differ)
        same = sum(next((i for i, (a, b) in enumerate(zip(o, e)) if a != b), len(e))
                   for o, e in zip(ours, expected))
        name = str(dtype).removeprefix("torch.") + ("_graphs" if graphs else "_eager")
        report[f"greedy_{name}_equal"] = ours == expected
        report[f"greedy_{name}_tokens_agree"] = f"{same}/{32 * len(prompts)}"
        print(f"{name}: outputs equal transformers: {ours == expected} "
              f"({same}/{32 * len(prompts)} tokens agree)")


@section("attention")
def attention_bench() -> None:
    import triton.testing

    from pagedserve.kernels.triton_decode_attention import paged_decode_attention_triton
    from pagedserve.kernels.triton_prefill_attention import paged_prefill_attention_triton

    hq, hkv, d, bs = 9, 3, 64, 16
    dev, dtype = "cuda", torch.bfloat16
    for batch, context in ((256, 512), (64, 2048), (1024, 1024)):
        blocks = batch * context // bs
        k = torch.randn(blocks, bs, hkv, d, device=dev, dtype=dtype)
        v = torch.randn_like(k)
        tables = torch.randperm(blocks, device=dev, dtype=torch.int64).to(torch.int32)
        tables = tables.view(batch, context // bs)
        lens = torch.full((batch,), context, device=dev, dtype=torch.int32)
        q = torch.randn(batch, hq, d, device=dev, dtype=dtype)
        gbytes = 2 * k.numel() * k.element_size() / 1e9
        for parts, tag in ((None, ""), (1, "_unsplit")):   # auto (split when few programs), 1
            ms = triton.testing.do_bench(
                lambda: paged_decode_attention_triton(q, k, v, tables, lens, d ** -0.5,
                                                      num_partitions=parts),
                warmup=50, rep=300, return_mode="median")
            report[f"decode_b{batch}_ctx{context}{tag}_us"] = round(ms * 1e3, 1)
            report[f"decode_b{batch}_ctx{context}{tag}_GBs"] = round(gbytes / (ms / 1e3))
            print(f"decode b{batch} ctx{context}{tag}: {ms * 1e3:8.1f} us, {gbytes * 1e3:.0f} MB "
                  f"of K/V -> {gbytes / (ms / 1e3):.0f} GB/s")
        del k, v
    for seqs, q_len in ((8, 512), (4, 2048)):
        context = q_len
        blocks = seqs * context // bs
        k = torch.randn(blocks, bs, hkv, d, device=dev, dtype=dtype)
        v = torch.randn_like(k)
        tables = torch.randperm(blocks, device=dev).to(torch.int32).view(seqs, context // bs)
        lens = torch.full((seqs,), context, device=dev, dtype=torch.int32)
        cu = torch.arange(seqs + 1, device=dev, dtype=torch.int32) * q_len
        q = torch.randn(seqs * q_len, hq, d, device=dev, dtype=dtype)
        ms = triton.testing.do_bench(
            lambda: paged_prefill_attention_triton(q, k, v, tables, cu, lens, d ** -0.5),
            warmup=50, rep=300, return_mode="median")
        flops = seqs * hq * 2 * 2 * d * q_len * context / 2   # causal: half the score matrix
        report[f"prefill_{seqs}x{q_len}_us"] = round(ms * 1e3, 1)
        report[f"prefill_{seqs}x{q_len}_TFLOPs"] = round(flops / (ms / 1e3) / 1e12, 1)
        print(f"prefill {seqs}x{q_len}: {ms * 1e3:8.1f} us -> {flops / (ms / 1e3) / 1e12:.1f} "
              "TFLOP/s")


@section("bench_step")
def bench_step(out: Path, model_files: Path, step_variants: str) -> None:
    variants = {"graphs": ("1,16,64,256", False), "eager": ("1,16,64,256", True),
                "graphs1024": ("1024", False)}
    for batches, eager in (variants[name] for name in step_variants.split(",")):
        proc = subprocess.run(
            [sys.executable, "scripts/bench_step.py", "--device", "cuda", "--random-weights",
             "--model", str(model_files), "--batch-sizes", batches]
            + (["--enforce-eager"] if eager else []),
            cwd=ROOT, capture_output=True, text=True, timeout=150)
        print(proc.stdout[-2500:], proc.stderr[-2500:] if proc.returncode else "")
        result = last_json(proc.stdout)
        tag = "eager_" if eager else ""
        report.update({f"step_{tag}{k}": v for k, v in result.items()
                       if k.startswith(("step_ms", "decode_tok", "hf_", "roofline", "b1_", "b256"))})


@section("throughput")
def throughput(out: Path, model_files: Path, sharegpt: Path | None, skip_hf: bool) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = Path(tempfile.mkdtemp(prefix="smollm2-random-"))
    for f in model_files.iterdir():
        if f.is_file():
            (model_dir / f.name).write_bytes(f.read_bytes())
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_files),
                                          dtype=torch.float32)
    hf.save_pretrained(model_dir)
    del hf
    cmd = [sys.executable, "scripts/bench_throughput.py", "--model", str(model_dir),
           "--num-prompts", "200", "--hf-num-prompts", "32", "--device", "cuda",
           "--kv-cache-memory", "8GiB"]
    if sharegpt:
        cmd += ["--dataset", str(sharegpt)]
    if skip_hf:
        cmd += ["--skip-hf"]
    log = out / "throughput.log"          # streamed, so a run cut short still shows progress
    with log.open("w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=240)
    text = log.read_text()
    print(text[-3000:])
    result = last_json(text)
    report["throughput_exit_code"] = proc.returncode
    report.update({f"throughput_{k}": v for k, v in result.items()
                   if k in ("output_tok_s", "hf_static_output_tok_s", "ratio_vs_hf",
                            "roofline_tok_s", "frac_of_roofline", "elapsed_s", "num_prompts")})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-files", type=Path, required=True,
                        help="a folder with SmolLM2's config.json and tokenizer files")
    parser.add_argument("--sharegpt", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    parser.add_argument("--skip", default="", help="comma-separated sections to leave out")
    parser.add_argument("--step-variants", default="graphs,eager,graphs1024",
                        help="bench_step runs: graphs and eager at b1-256, graphs1024 at b1024")
    parser.add_argument("--skip-hf", action="store_true",
                        help="throughput: leave out transformers' static batching (~90 s)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("cuda_check.py needs a CUDA GPU (torch sees none)")
    args.out.mkdir(parents=True, exist_ok=True)
    report["device_name"] = torch.cuda.get_device_name()
    report["torch"] = torch.__version__
    import triton
    report["triton"] = triton.__version__
    print(f"{report['device_name']}, torch {torch.__version__}, triton {triton.__version__}")
    skip = set(args.skip.split(","))
    if "kernels" not in skip:
        kernel_tests(args.out)
    if "native" not in skip:
        native_tests(args.out)
    if "greedy" not in skip:
        greedy_check()
    if "attention" not in skip:
        attention_bench()
    if "bench_step" not in skip:
        bench_step(args.out, args.model_files, args.step_variants)
    if "throughput" not in skip:
        throughput(args.out, args.model_files, args.sharegpt, args.skip_hf)
    (args.out / "cuda_check.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
