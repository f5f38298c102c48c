"""Offline throughput: N ShareGPT requests through our engine vs. transformers static batching.

Requests are the first turns of ShareGPT conversations (sampled with --seed), kept when the
prompt has 4..1024 tokens, the reply at least 4, and prompt + reply <= 2048 tokens in the
model's tokenizer. The prompt is the human turn wrapped in the model's chat template (with the
generation prompt; `--prompt-format raw` sends the bare text instead); the output length is the
reference reply's token count, generated greedily with `ignore_eos` so every run does the same
work.

1. Our engine: all requests handed to `pipeline.LLM.generate` at once (after one warm-up
   request); the clock runs from submission to the last output.
2. transformers static batching, same dtype and token ids: batches of --hf-batch-size (16) in
   arrival order, left padded, each batch generating to its longest output
   (`min_new_tokens = max_new_tokens = longest`, greedy). Only each request's own output length
   counts as useful tokens. `--hf-num-prompts K` measures the first K requests only (tok/s is a
   rate; the report says so); `--skip-hf` skips it.
3. The bf16 matmul roofline exactly as `scripts/bench_step.py` computes it (its
   `matmul_rates`: the model's linear shapes at 256 rows, the faster of F.linear and the
   engine's own linear, tok/s = FLOP/s / (2 x params)); F.linear's alone is reported beside it.

    .venv/bin/python scripts/bench_throughput.py                        # N=200, bf16
    .venv/bin/python scripts/bench_throughput.py --num-prompts 32 --hf-num-prompts 16

The last line is one JSON object (output_tok_s, hf_static_output_tok_s, ratio_vs_hf,
roofline_tok_s, frac_of_roofline, num_prompts, ...).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
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

from pagedserve.workers.loader import DEFAULT_MODEL, load_config, resolve_model  # noqa: E402

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
    """ShareGPT first turns in a seeded random order, filtered by the length limits."""
    import sharegpt

    pairs = list(sharegpt.first_turns(dataset, limit=max(num_prompts * 8, 1000)))
    random.Random(seed).shuffle(pairs)
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

def roofline_tok_s(config, dtype: torch.dtype, device: str, tokens: int = 256
                   ) -> tuple[float, float, float]:
    """(tok/s, matmul FLOP/s, F.linear's FLOP/s): bench_step's matmul roofline at `tokens` rows
    (the faster of F.linear and the engine's own linear), and F.linear's alone."""
    import bench_step

    torch_flops, engine_flops, params = bench_step.matmul_rates(config, tokens, dtype, device)
    flops = max(torch_flops, engine_flops)
    return flops / (2 * params), flops, torch_flops


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

def run_hf_static(requests: list[BenchRequest], model_dir: Path, dtype: torch.dtype, device: str,
                  batch_size: int, pad_id: int) -> dict:
    """Static batches in arrival order, each generating to its longest output."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    batches = [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]
    padded_tokens = 0
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _generate_batch(hf, batches[0][:1], 2, pad_id, device)  # warm-up
        start = time.perf_counter()
        for n, batch in enumerate(batches):
            longest = max(r.output_len for r in batch)
            t0 = time.perf_counter()
            _generate_batch(hf, batch, longest, pad_id, device)
            padded_tokens += longest * len(batch)
            print(f"  hf batch {n + 1}/{len(batches)}: {len(batch)} requests to {longest} tokens "
                  f"in {time.perf_counter() - t0:.1f}s", flush=True)
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
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--hf-num-prompts", type=int, default=None,
                   help="measure transformers on the first K requests only (default: all)")
    p.add_argument("--hf-batch-size", type=int, default=16)
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
                        "and the roofline stay at --dtype")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-memory", default=None, help="per worker rank, e.g. 2GiB")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="compute threads per CPU worker rank (default: the engine's)")
    p.add_argument("--in-process", action="store_true",
                   help="run the engine's cores in this process (EngineCore, TP=1) instead of "
                        "the process group")
    p.add_argument("--no-store", action="store_true",
                   help="do not write the result under benchmarks/results/")
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

    roofline, flops, torch_flops = roofline_tok_s(load_config(model_dir), dtype, device,
                                                  args.roofline_tokens)
    torch_roofline = roofline * torch_flops / flops
    print(f"roofline ({args.dtype} matmuls at {args.roofline_tokens} rows, bench_step's method): "
          f"{flops / 1e9:.0f} GFLOP/s -> {roofline:.0f} tok/s (F.linear alone: "
          f"{torch_flops / 1e9:.0f} GFLOP/s -> {torch_roofline:.0f} tok/s)", flush=True)

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
              "roofline_tok_s": round(roofline, 1),
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
    if not args.no_store:
        import bench_record
        print(f"stored in {bench_record.store('bench_throughput', report, argv)}", flush=True)
    print(json.dumps(report), flush=True)
    return report


def compare_with_hf(requests: list[BenchRequest], args: argparse.Namespace, model_dir: Path,
                    tokenizer, dtype: torch.dtype, device: str, our_output_tok_s: float) -> dict:
    """transformers static batching on all requests or the first --hf-num-prompts."""
    subset = requests[:args.hf_num_prompts] if args.hf_num_prompts else requests
    what = ("all requests" if len(subset) == len(requests) else
            f"the first {len(subset)} of {len(requests)} requests; its rate stands for all")
    print(f"transformers static batching, batches of {args.hf_batch_size}, on {what}:", flush=True)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    hf = run_hf_static(subset, model_dir, dtype, device, args.hf_batch_size, pad_id)
    ratio = our_output_tok_s / hf["output_tok_s"]
    print(f"transformers static: {hf['requests']} requests in {hf['elapsed_s']:.1f}s: "
          f"{hf['requests_s']:.2f} requests/s, {hf['output_tok_s']:.1f} useful output tok/s "
          f"({hf['padded_output_tokens']} generated for {hf['output_tokens']} useful), "
          f"{hf['total_tok_s']:.1f} total tok/s", flush=True)
    print(f"pagedserve / transformers static: {ratio:.2f}x output tok/s", flush=True)
    return {"hf_static_output_tok_s": round(hf["output_tok_s"], 1),
            "hf_static_requests_s": round(hf["requests_s"], 3), "hf_num_prompts": hf["requests"],
            "hf_elapsed_s": round(hf["elapsed_s"], 2),
            "hf_extrapolated": hf["requests"] < len(requests), "ratio_vs_hf": round(ratio, 2)}


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
