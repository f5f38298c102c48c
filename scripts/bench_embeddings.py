"""Embedding throughput on ShareGPT prompts: our engine (a launched group, every prompt handed
to `LLM.embed` at once and batched by the scheduler) against transformers batching the way
sentence-transformers' `encode` does, on the same CPU and threads.

Prompts are ShareGPT first turns (sharegpt.sample_first_turns, seeded), kept when they have
--min-tokens .. --max-tokens tokens in the model's tokenizer (256: all-MiniLM-L6-v2's
max_seq_length, so the reference truncates nothing and both sides embed the same tokens).

1. Ours: `LLM(model).embed(prompts)` after a warm-up request; the clock runs from the call to
   the last vector (tokenization included).
2. The reference: sentence-transformers' algorithm in transformers (the model's modules.json:
   BERT, mean pooling over the attention mask, normalize): prompts sorted by length, batches
   of --batch-size, padded per batch; tokenization included. torch uses the worker's threads.

The two run alternately --rounds times (medians reported, every run in the JSON), so that a
shared host's load weighs on both alike. Both sides' vectors are compared (min cosine). The
last line is one JSON object (ours_seq_s, ours_tok_s, ref_seq_s, ref_tok_s, ratio, min_cosine,
...), stored under benchmarks/results/bench_embeddings/ (scripts/bench_record.py) unless
--no-store.

    .venv/bin/python scripts/bench_embeddings.py --num-prompts 256
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import bench_record  # noqa: E402

from pagedserve.pipeline.tokenizer import load_tokenizer  # noqa: E402
from pagedserve.workers.loader import resolve_model  # noqa: E402


def sample_prompts(tokenizer, num_prompts: int, *, seed: int, min_tokens: int,
                   max_tokens: int, dataset: str | None = None) -> list[str]:
    """ShareGPT first turns with min_tokens..max_tokens tokens, in the sample's order."""
    import sharegpt
    prompts = []
    for prompt, _reply in sharegpt.sample_first_turns(max(num_prompts * 8, 1000), seed, dataset):
        if min_tokens <= len(tokenizer.encode(prompt)) <= max_tokens:
            prompts.append(prompt)
            if len(prompts) == num_prompts:
                return prompts
    raise SystemExit(f"only {len(prompts)} prompts of {min_tokens}..{max_tokens} tokens found")


class Ours:
    """A launched group (LLM), warmed up; `embed` times one pass over the prompts."""

    def __init__(self, model_dir: Path, args) -> None:
        from pagedserve import LLM
        kwargs = {"dtype": args.dtype, "kv_cache_memory": "256MiB",
                  "max_num_batched_tokens": args.max_num_batched_tokens}
        if args.cpu_threads:
            kwargs["cpu_threads"] = args.cpu_threads
        self.llm = LLM(model=str(model_dir), **kwargs)

    def embed(self, prompts: list[str]) -> tuple[float, np.ndarray]:
        start = time.perf_counter()
        outs = self.llm.embed(prompts)
        seconds = time.perf_counter() - start
        return seconds, np.array([o.outputs.embedding for o in outs], dtype=np.float32)


class Reference:
    """sentence-transformers' encode() in transformers: length-sorted batches of batch_size,
    padded per batch, mean over the attention mask, normalize; tokenization timed too."""

    def __init__(self, model_dir: Path, args) -> None:
        from transformers import AutoModel, AutoTokenizer
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModel.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).eval()
        self.batch_size, self.max_tokens = args.batch_size, args.max_tokens

    def embed(self, prompts: list[str]) -> tuple[float, np.ndarray]:
        start = time.perf_counter()
        order = np.argsort([-len(p) for p in prompts], kind="stable")
        out = np.zeros((len(prompts), self.model.config.hidden_size), np.float32)
        with torch.inference_mode():
            for i in range(0, len(prompts), self.batch_size):
                rows = order[i:i + self.batch_size]
                batch = self.tokenizer([prompts[r] for r in rows], padding=True, truncation=True,
                                       max_length=self.max_tokens, return_tensors="pt")
                hidden = self.model(**batch).last_hidden_state
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                out[rows] = torch.nn.functional.normalize(pooled.float(), dim=-1).numpy()
        return time.perf_counter() - start, out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="all-MiniLM-L6-v2")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-tokens", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32, help="the reference's (ST's default)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--rounds", type=int, default=3, help="alternated runs of each; medians")
    p.add_argument("--cpu-threads", type=int, default=0, help="0: the engine's default (the "
                   "cores); the reference uses as many")
    p.add_argument("--dataset", default=None, help="a ShareGPT JSON file (default: fetched)")
    bench_record.add_no_store_flag(p)
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer(model_dir)
    prompts = sample_prompts(tokenizer, args.num_prompts, seed=args.seed,
                             min_tokens=args.min_tokens, max_tokens=args.max_tokens,
                             dataset=args.dataset)
    num_tokens = sum(len(tokenizer.encode(p)) for p in prompts)
    threads = args.cpu_threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    engine, reference = Ours(model_dir, args), Reference(model_dir, args)
    try:
        engine.embed(prompts[:1]), reference.embed(prompts[:1])  # warm-up
        ours_runs, ref_runs = [], []
        for _ in range(args.rounds):  # alternated: a shared host's load hits both alike
            ours_s, vectors = engine.embed(prompts)
            ref_s, ref = reference.embed(prompts)
            ours_runs.append(ours_s)
            ref_runs.append(ref_s)
    finally:
        engine.llm.close()
    ours_s, ref_s = float(np.median(ours_runs)), float(np.median(ref_runs))
    cosine = (vectors * ref).sum(1) / np.linalg.norm(vectors, axis=1) / np.linalg.norm(ref, axis=1)
    result = {"model": args.model, "num_prompts": len(prompts), "prompt_tokens": num_tokens,
              "dtype": args.dtype, "threads": threads, "ref_batch_size": args.batch_size,
              "max_num_batched_tokens": args.max_num_batched_tokens,
              "ours_s": round(ours_s, 3), "ours_seq_s": round(len(prompts) / ours_s, 2),
              "ours_tok_s": round(num_tokens / ours_s, 1), "ref_s": round(ref_s, 3),
              "ref_seq_s": round(len(prompts) / ref_s, 2),
              "ref_tok_s": round(num_tokens / ref_s, 1), "ratio": round(ref_s / ours_s, 3),
              "min_cosine": float(cosine.min()), "rounds": args.rounds,
              "ours_runs_s": [round(x, 3) for x in ours_runs],
              "ref_runs_s": [round(x, 3) for x in ref_runs],
              "reference": "transformers with sentence-transformers' pooling (mean, normalize)"}
    bench_record.finish("bench_embeddings", result, args.no_store, argv)
    return result


if __name__ == "__main__":
    main()
