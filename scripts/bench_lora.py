"""A decode step with LoRA adapters against the same step without them (issue 43).

The model runner's whole step (bench_step.py's machinery: tensor preparation, forward, logits
of every row) at --batch rows decoding at --context, first with no adapter, then with
--adapters distinct random adapters of --rank on every projection (q, k, v, o, gate, up,
down), the rows dealt round-robin to them, all resident in --adapters slots (rows of one slot
go through the segmented shrink/expand together: workers/lora/). The two are timed
alternately, --rounds times each (each timing the median of --repeats steps). `overhead` is the
ratio of the fastest timing of each, minus one: on a shared host the least disturbed step of
each is the fairest pair (other processes' bursts land on either side at random);
`overhead_median` is that of their medians.
The adapters are PEFT folders written with random tensors into a temporary folder.
The last line is one JSON object, stored under benchmarks/results/bench_lora/ unless
--no-store.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_record  # noqa: E402
from bench_step import cpu_info, timed  # noqa: E402

from pagedserve.kernels import native  # noqa: E402
from pagedserve.pipeline.lora_files import TARGETS  # noqa: E402
from pagedserve.pipeline.lora_request import LoRARequest  # noqa: E402
from pagedserve.workers.lora.setup import LoRASetup, base_shapes  # noqa: E402
from pagedserve.workers.loader import TEST_MODEL, load_config, resolve_model  # noqa: E402
from pagedserve.workers.model_runner import ModelRunner, SeqStep  # noqa: E402


def write_adapter(folder: Path, config, rank: int, seed: int) -> Path:
    """A PEFT LoRA folder of random A and B (std 0.02) on every projection of every layer."""
    from safetensors.torch import save_file
    base = base_shapes(config)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module in TARGETS:
            fan_in, fan_out = base.features(module)
            where = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = f"base_model.model.model.layers.{layer}.{where}.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.02
            tensors[f"{name}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.02
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": TARGETS}))
    return folder


def decode_items(runner: ModelRunner, batch: int, context: int) -> list[SeqStep]:
    per_seq = -(-context // runner.block_size)
    return [SeqStep([(17 * b) % runner.config.vocab_size], context - 1,
                    list(range(b * per_seq, (b + 1) * per_seq)), True) for b in range(batch)]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=TEST_MODEL)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5, help="alternated timings of each")
    parser.add_argument("--repeats", type=int, default=3, help="steps per timing (median)")
    parser.add_argument("--threads", type=int, default=None)
    bench_record.add_no_store_flag(parser)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    config = load_config(model_dir)
    per_seq = -(-args.context // args.block_size)
    runner = ModelRunner(config, model_dir, torch.float32, "cpu", args.block_size,
                         args.batch * per_seq, quantization="auto",
                         lora=LoRASetup(args.adapters, max(16, args.rank), args.adapters))
    base = decode_items(runner, args.batch, args.context)
    adapted = decode_items(runner, args.batch, args.context)
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.adapters):
            runner.lora.register(LoRARequest(lora_name=f"bench{i}", lora_int_id=i + 1,
                                             lora_path=str(write_adapter(
                                                 Path(tmp, f"a{i}"), config, args.rank, i))))
    for b, item in enumerate(adapted):
        item.lora_id = 1 + b % args.adapters
    base_ms, lora_ms = [], []
    for _ in range(args.rounds):
        base_ms.append(timed(lambda: runner.execute(base), args.repeats) * 1e3)
        lora_ms.append(timed(lambda: runner.execute(adapted), args.repeats) * 1e3)
    base_med, lora_med = statistics.median(base_ms), statistics.median(lora_ms)
    base_min, lora_min = min(base_ms), min(lora_ms)
    result = {"model": args.model, "quantization": runner.quantization, "batch": args.batch,
              "adapters": args.adapters, "rank": args.rank, "context": args.context,
              "threads": torch.get_num_threads(), "base_step_ms": round(base_min, 2),
              "lora_step_ms": round(lora_min, 2), "overhead": round(lora_min / base_min - 1, 4),
              "overhead_median": round(lora_med / base_med - 1, 4),
              "base_step_ms_all": [round(t, 2) for t in base_ms],
              "lora_step_ms_all": [round(t, 2) for t in lora_ms],
              "native_variant": native.variant(), **cpu_info()}
    bench_record.finish("bench_lora", result, args.no_store, argv)
    return result


if __name__ == "__main__":
    main()
