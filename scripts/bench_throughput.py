"""Offline throughput: N ShareGPT requests through our engine vs. transformers static batching.

Requests are first turns of ShareGPT conversations, drawn with --seed as a uniform sample of
the whole file (sharegpt.sample_first_turns: max(8 N, 1000) candidates, taken in the sample's
order until N pass the filters), kept when the prompt has 4..1024 tokens, the reply at least 4, and prompt + reply <= 2048 tokens in the
model's tokenizer. The prompt is the human turn wrapped in the model's chat template (with the
generation prompt; `--prompt-format raw` sends the bare text instead); the output length is the
reference reply's token count, generated greedily with `ignore_eos` so every run does the same
work.

1. Our engine: all requests handed to `pipeline.LLM.generate` at once (after one warm-up
   request); the clock runs from submission to the last output.
2. transformers static batching, same dtype and token ids, swept over --hf-batch-sizes
   (8,16,32,64): for each size, batches in arrival order, left padded, each batch generating to
   its longest output (`min_new_tokens = max_new_tokens = longest`, greedy). Only each request's
   own output length counts as useful tokens. The best size's rate is the baseline; every size's
   figures are in the JSON (`hf_sweep`). It runs on all N requests, or with `--hf-num-prompts K`
   on K of them drawn at random with --seed (kept in arrival order; tok/s is a rate, and
   `hf_sample` says which). The sweep costs the sum of its sizes' runs; `--skip-hf` skips it.
3. The roofline exactly as `scripts/bench_step.py` computes it (its `matmul_rates` and
   `roofline`: the model's linear shapes at 256 rows in the arithmetic the engine runs: --dtype's
   product, the faster of F.linear and the engine's linear, or with `--quantization int8` the
   int8 linear's; tok/s = FLOP/s / (2 x params)); `roofline` in the JSON names it. F.linear's
   rate in --dtype alone is reported beside it.

    .venv/bin/python scripts/bench_throughput.py                        # N=200, bf16
    .venv/bin/python scripts/bench_throughput.py --num-prompts 32 --hf-num-prompts 16

The last line is one JSON object (output_tok_s, hf_static_output_tok_s, hf_best_batch_size,
hf_sweep, ratio_vs_hf, roofline, roofline_tok_s, frac_of_roofline, num_prompts, ...), stored
under benchmarks/results/bench_throughput/ (scripts/bench_record.py) unless --no-store.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import random
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402

import bench_record  # noqa: E402

from pagedserve.workers.loader import TEST_MODEL, load_config, resolve_model  # noqa: E402

from pagedserve.pipeline.tokenizer import load_tokenizer

MIN_TOKENS = 4  # vLLM's benchmark drops prompts and replies shorter than this


@dataclass(slots=True)
class BenchRequest:
    prompt_ids: list[int]
    output_len: int


# ------------------------------------------------------------------------------------ dataset

def sample_requests(tokenizer, num_prompts: int, *, seed: int, prompt_format: str,
                    max_prompt_len: int, max_total_len: int,
                    dataset: str | None = None) -> list[BenchRequest]:
    """ShareGPT first turns, filtered by the length limits: candidates are a seeded uniform
    sample of max(8 N, 1000) first turns of the whole file (sharegpt.sample_first_turns), taken
    in that sample's order until N pass."""
    import sharegpt

    pairs = sharegpt.sample_first_turns(max(num_prompts * 8, 1000), seed, dataset)
    requests: list[BenchRequest] = []
    for prompt, reply in pairs:
        if prompt_format == "chat":
            ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        else:
            ids = tokenizer.encode(prompt)
        output_len = len(tokenizer.encode(reply, add_special_tokens=False))
        if (len(ids) < MIN_TOKENS or output_len < MIN_TOKENS or len(ids) > max_prompt_len
                or len(ids) + output_len > max_total_len):
            continue
        requests.append(BenchRequest(ids, output_len))
        if len(requests) == num_prompts:
            break
    if len(requests) < num_prompts:
        print(f"note: only {len(requests)} ShareGPT prompts passed the filters", file=sys.stderr)
    return requests


# ------------------------------------------------------------------------------------ roofline

def roofline_tok_s(config, dtype: torch.dtype, device: str, tokens: int = 256,
                   quantization: str = "none") -> tuple[float, float, float, str]:
    """(tok/s, its FLOP/s, F.linear's FLOP/s in `dtype`, what the roofline is): bench_step's
    roofline of the arithmetic the engine runs, at `tokens` rows."""
    import bench_step

    rates = bench_step.matmul_rates(config, tokens, dtype, device, quantization)
    flops, name = bench_step.roofline(rates, dtype, tokens, quantization)
    return flops / (2 * rates["params"]), flops, rates["torch"], name


# ------------------------------------------------------------------------------------ engine

def run_engine(requests: list[BenchRequest], model: str, engine_kwargs: dict,
               progress_s: float = 30.0, in_process: bool = False) -> dict:
    """All requests submitted at once (what `LLM.generate` does), with a progress line every
    `progress_s` seconds from the scheduler's stats. `in_process`: on an EngineCore in this
    process (LLM(in_process=True)) instead of the process group."""
    from pagedserve.pipeline import LLM, SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
              for r in requests]
    wanted = sum(r.output_len for r in requests)
    with LLM(model=model, in_process=in_process, **engine_kwargs) as llm:
        llm.generate([requests[0].prompt_ids], SamplingParams(temperature=0.0, max_tokens=4,
                                                              ignore_eos=True))  # warm-up
        if in_process:  # the EngineCore steps inside generate(): no progress lines
            start = time.perf_counter()
            outputs = llm.generate([r.prompt_ids for r in requests], params)
            elapsed = time.perf_counter() - start
            return _checked(requests, outputs, elapsed, llm.stats()["num_preemptions"])
        base = llm.stats()["generation_tokens"]
        start = time.perf_counter()
        futures = [llm.client.submit(r.prompt_ids, p) for r, p in zip(requests, params)]
        pending = set(futures)
        while pending:
            _, pending = concurrent.futures.wait(pending, timeout=progress_s)
            if pending:
                stats = llm.stats()
                print(f"  {time.perf_counter() - start:6.0f}s: {len(requests) - len(pending)}/"
                      f"{len(requests)} done, {stats['generation_tokens'] - base}/{wanted} "
                      f"tokens, {stats['num_requests_running']} running, "
                      f"{stats['num_preemptions']} preemptions", flush=True)
        elapsed = time.perf_counter() - start
        outputs = [f.result() for f in futures]
        preemptions = llm.stats()["num_preemptions"]
    return _checked(requests, outputs, elapsed, preemptions)


def _checked(requests: list[BenchRequest], outputs: list, elapsed: float,
             preemptions: int) -> dict:
    got = [len(o.outputs[0].token_ids) for o in outputs]
    wrong = [(i, g, r.output_len) for i, (g, r) in enumerate(zip(got, requests)) if g != r.output_len]
    if wrong:
        raise RuntimeError(f"{len(wrong)} requests came back with the wrong length "
                           f"(index, got, wanted): {wrong[:5]}")
    return {**_rates(requests, elapsed), "preemptions": preemptions}


def _rates(requests: list[BenchRequest], elapsed: float) -> dict:
    out_tokens = sum(r.output_len for r in requests)
    all_tokens = out_tokens + sum(len(r.prompt_ids) for r in requests)
    return {"elapsed_s": elapsed, "requests": len(requests), "output_tokens": out_tokens,
            "requests_s": len(requests) / elapsed, "output_tok_s": out_tokens / elapsed,
            "total_tok_s": all_tokens / elapsed}


# ------------------------------------------------------------------------------------ transformers

def hf_sample(requests: list[BenchRequest], k: int | None, seed: int
              ) -> tuple[list[BenchRequest], str]:
    """The requests transformers runs, and how they were chosen: all of them, or k drawn at
    random with `seed` (not the first k: those would be a biased slice of the lengths), kept in
    arrival order."""
    if not k or k >= len(requests):
        return requests, f"all {len(requests)} requests"
    chosen = sorted(random.Random(seed).sample(range(len(requests)), k))
    return ([requests[i] for i in chosen],
            f"a random sample of {k} of the {len(requests)} requests (seed {seed}); its rate "
            f"stands for all")


def sweep_batch_sizes(run_static, batch_sizes: list[int]) -> tuple[dict, list[dict]]:
    """Run static batching at each size (`run_static(batch_size) -> rates`); the best size's rates
    (highest useful output tok/s) and every size's, in the order run."""
    sweep = [{"batch_size": size, **run_static(size)} for size in batch_sizes]
    return max(sweep, key=lambda rates: rates["output_tok_s"]), sweep


def run_hf_static(hf, requests: list[BenchRequest], device: str, batch_size: int,
                  pad_id: int) -> dict:
    """Static batches in arrival order, each generating to its longest output."""
    batches = [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]
    padded_tokens = 0
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start = time.perf_counter()
        for n, batch in enumerate(batches):
            longest = max(r.output_len for r in batch)
            t0 = time.perf_counter()
            _generate_batch(hf, batch, longest, pad_id, device)
            padded_tokens += longest * len(batch)
            print(f"  hf batch size {batch_size}, batch {n + 1}/{len(batches)}: {len(batch)} "
                  f"requests to {longest} tokens in {time.perf_counter() - t0:.1f}s", flush=True)
        elapsed = time.perf_counter() - start
    rates = _rates(requests, elapsed)
    rates["padded_output_tokens"] = padded_tokens
    return rates


def _generate_batch(hf, batch: list[BenchRequest], new_tokens: int, pad_id: int, device: str):
    width = max(len(r.prompt_ids) for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, r in enumerate(batch):  # left padding
        ids[row, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
        mask[row, width - len(r.prompt_ids):] = 1
    out = hf.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                      max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                      pad_token_id=pad_id)
    if out.shape[1] != width + new_tokens:
        raise RuntimeError(f"transformers generated {out.shape[1] - width} tokens, "
                           f"expected {new_tokens}")
    return out


# ------------------------------------------------------------------------------------ main

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=TEST_MODEL)
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--hf-num-prompts", type=int, default=None,
                   help="measure transformers on K of the requests drawn at random with --seed "
                        "(default: all)")
    p.add_argument("--hf-batch-sizes", default="8,16,32,64",
                   help="transformers' static batch sizes to sweep; the best one is reported")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--prompt-format", choices=["chat", "raw"], default="chat")
    p.add_argument("--max-prompt-len", type=int, default=1024)
    p.add_argument("--max-total-len", type=int, default=2048)
    p.add_argument("--dataset", default=None, help="ShareGPT JSON (default: fetched and cached)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--quantization", default="none", choices=["none", "int8"],
                   help="the engine's --quantization (int8: CPU, --dtype float32); transformers "
                        "stays at --dtype, the roofline becomes the int8 linear's")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-memory", default=None, help="per worker rank, e.g. 2GiB")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="compute threads per CPU worker rank (default: the engine's)")
    p.add_argument("--in-process", action="store_true",
                   help="run the engine's cores in this process (EngineCore, TP=1) instead of "
                        "the process group")
    bench_record.add_no_store_flag(p)
    p.add_argument("--roofline-tokens", type=int, default=256,
                   help="rows of the roofline matmuls (bench_step uses its largest batch, 256)")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer(model_dir)
    requests = sample_requests(tokenizer, args.num_prompts, seed=args.seed,
                               prompt_format=args.prompt_format,
                               max_prompt_len=args.max_prompt_len,
                               max_total_len=args.max_total_len, dataset=args.dataset)
    if not requests:
        raise SystemExit("no ShareGPT request passed the filters")
    prompt_lens = [len(r.prompt_ids) for r in requests]
    out_lens = [r.output_len for r in requests]
    print(f"{len(requests)} ShareGPT requests ({args.prompt_format} prompts), prompt tokens "
          f"mean {sum(prompt_lens) / len(requests):.0f} max {max(prompt_lens)}, output tokens "
          f"mean {sum(out_lens) / len(requests):.0f} max {max(out_lens)}; {args.dtype} on "
          f"{device}, {os.cpu_count()} cpus, load {_loadavg()}", flush=True)

    roofline, flops, torch_flops, roofline_name = roofline_tok_s(
        load_config(model_dir), dtype, device, args.roofline_tokens, args.quantization)
    torch_roofline = roofline * torch_flops / flops
    print(f"roofline ({roofline_name}, bench_step's method): {flops / 1e9:.0f} GFLOP/s -> "
          f"{roofline:.0f} tok/s (F.linear in {args.dtype} alone: {torch_flops / 1e9:.0f} GFLOP/s "
          f"-> {torch_roofline:.0f} tok/s)", flush=True)

    engine_kwargs = {"dtype": args.dtype, "device": device, "seed": args.seed,
                     "quantization": args.quantization,
                     "max_num_seqs": args.max_num_seqs,
                     "max_num_batched_tokens": args.max_num_batched_tokens,
                     "tensor_parallel_size": args.tensor_parallel_size}
    if args.kv_cache_memory:
        engine_kwargs["kv_cache_memory"] = args.kv_cache_memory
    if args.cpu_threads:
        engine_kwargs["cpu_threads"] = args.cpu_threads
    ours = run_engine(requests, str(model_dir), engine_kwargs, in_process=args.in_process)
    print(f"pagedserve: {ours['requests']} requests in {ours['elapsed_s']:.1f}s: "
          f"{ours['requests_s']:.2f} requests/s, {ours['output_tok_s']:.1f} output tok/s, "
          f"{ours['total_tok_s']:.1f} total tok/s ({100 * ours['output_tok_s'] / roofline:.1f}% "
          f"of roofline)", flush=True)

    import bench_step
    report = {"model": args.model, "dtype": args.dtype, "quantization": args.quantization,
              "device": device, **bench_step.cpu_info(),
              "prompt_format": args.prompt_format, "num_prompts": len(requests),
              "elapsed_s": round(ours["elapsed_s"], 2), "requests_s": round(ours["requests_s"], 3),
              "output_tok_s": round(ours["output_tok_s"], 1),
              "total_tok_s": round(ours["total_tok_s"], 1),
              "roofline": roofline_name, "roofline_tok_s": round(roofline, 1),
              "frac_of_roofline": round(ours["output_tok_s"] / roofline, 3),
              "torch_roofline_tok_s": round(torch_roofline, 1),
              "frac_of_torch_roofline": round(ours["output_tok_s"] / torch_roofline, 3),
              "hf_static_output_tok_s": None, "hf_num_prompts": 0, "ratio_vs_hf": None,
              "preemptions": ours["preemptions"], "cpu_threads": args.cpu_threads,
              "in_process": args.in_process, "load_avg": _loadavg()}
    if not args.skip_hf:
        report.update(compare_with_hf(requests, args, model_dir, tokenizer, dtype, device,
                                      ours["output_tok_s"]))
    print(f"targets (issue 6, meant for N=200): >= 10x transformers static: "
          f"{_verdict(report['ratio_vs_hf'], 10)}; >= 40% of roofline: "
          f"{_verdict(report['frac_of_roofline'], 0.4)}", flush=True)
    bench_record.finish("bench_throughput", report, args.no_store, argv)
    return report


def compare_with_hf(requests: list[BenchRequest], args: argparse.Namespace, model_dir: Path,
                    tokenizer, dtype: torch.dtype, device: str, our_output_tok_s: float) -> dict:
    """transformers static batching swept over --hf-batch-sizes; the best size is the baseline."""
    subset, what = hf_sample(requests, args.hf_num_prompts, args.seed)
    sizes = [int(b) for b in args.hf_batch_sizes.split(",")]
    print(f"transformers static batching, batch sizes {sizes}, on {what}:", flush=True)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    from pagedserve.workers.testing import hf_model
    hf = hf_model.__wrapped__(model_dir).to(dtype).to(device).eval()   # uncached: converted here
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _generate_batch(hf, subset[:1], 2, pad_id, device)  # warm-up
    best, sweep = sweep_batch_sizes(
        lambda size: run_hf_static(hf, subset, device, size, pad_id), sizes)
    for rates in sweep:
        print(f"transformers static, batches of {rates['batch_size']}: {rates['requests']} "
              f"requests in {rates['elapsed_s']:.1f}s, {rates['output_tok_s']:.1f} useful output "
              f"tok/s ({rates['padded_output_tokens']} generated for {rates['output_tokens']} "
              f"useful)", flush=True)
    ratio = our_output_tok_s / best["output_tok_s"]
    print(f"pagedserve / transformers static (best: batches of {best['batch_size']}): "
          f"{ratio:.2f}x output tok/s", flush=True)
    return {"hf_static_output_tok_s": round(best["output_tok_s"], 1),
            "hf_static_requests_s": round(best["requests_s"], 3),
            "hf_best_batch_size": best["batch_size"], "hf_num_prompts": best["requests"],
            "hf_elapsed_s": round(best["elapsed_s"], 2), "hf_sample": what,
            "hf_extrapolated": best["requests"] < len(requests), "ratio_vs_hf": round(ratio, 2),
            "hf_sweep": [{"batch_size": r["batch_size"],
                          "output_tok_s": round(r["output_tok_s"], 2),
                          "requests_s": round(r["requests_s"], 3),
                          "elapsed_s": round(r["elapsed_s"], 2),
                          "padded_output_tokens": r["padded_output_tokens"]} for r in sweep]}


def _verdict(value: float | None, target: float) -> str:
    if value is None:
        return "not measured"
    return f"{value:g} {'met' if value >= target else 'NOT met'}"


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


if __name__ == "__main__":
    main()
