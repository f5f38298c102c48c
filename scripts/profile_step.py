"""Where one step of a model goes on this CPU, by component: each linear family (qkv, o,
gate_up, down), the LM head, attention proper, the rest of the forward (norms, rope, embedding,
residuals, Python), and sampling; for decode steps at each batch size and for one prefill chunk.

    python scripts/profile_step.py                       # the default model (Qwen2.5-Coder 0.5B GGUF)
    python scripts/profile_step.py --model SmolLM2-135M-Instruct --batch-sizes 1,64

Two timings per shape, with the same runner and cache (random K/V, every sequence its own blocks
of `--context` tokens, as scripts/bench_step.py sets them):
- `step_ms`: the runner's whole `execute` as a serving worker runs it (decode steps of up to
  64 rows replay their recorded native kernel calls, workers/cpu_decode_replay.py), plus
  `sample_ms`, the worker's sampler over the step's logits (greedy and top-p rows alternating).
- `replay_ms`: for a replayed step, its native calls by kind and what runs outside them.
- `parts_ms`: the same step run eagerly with timing hooks on every module (hooks cost a few
  microseconds each, so parts add up to a little more than an untraced eager step, `eager_ms`).
`floor_ms`: the weight bytes one decode step reads (the linears as stored and the LM head) over
this host's streaming read bandwidth (a sum over 1 GiB on the step's threads, `--copy-mib`) - the
least a one-stream step can take; `copy_gb_s` (read + write of a 1 GiB copy) beside it.
The last line is one JSON object, stored under benchmarks/results/profile_step/.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_record  # noqa: E402
from bench_step import cpu_info, timed  # noqa: E402

from pagedserve.kernels import native  # noqa: E402
from pagedserve.kernels.kv_format import to_storage  # noqa: E402
from pagedserve.kernels.native_replay import OP_KINDS  # noqa: E402
from pagedserve.pipeline.config import ModelArgs  # noqa: E402
from pagedserve.workers.loader import load_config, resolve_model  # noqa: E402
from pagedserve.workers.model_runner import ModelRunner, SeqStep  # noqa: E402
from pagedserve.workers.models.decoder import DecoderAttention  # noqa: E402
from pagedserve.workers.models.layers import PackableLinear  # noqa: E402

FAMILIES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class Hooks:
    """Seconds per component of eager forwards: each linear family, attention less its
    projections, and the LM head (compute_logits)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        for name, module in model.named_modules():
            family = name.rsplit(".", 1)[-1]
            if isinstance(module, DecoderAttention):
                self._hook(module, "attention_with_projections")
            elif isinstance(module, PackableLinear) and family in FAMILIES:
                self._hook(module, family)
        logits = model.compute_logits

        def timed_logits(hidden):
            start = time.perf_counter()
            out = logits(hidden)
            self.seconds["lm_head"] += time.perf_counter() - start
            return out
        model.compute_logits = timed_logits

    def _hook(self, module: torch.nn.Module, kind: str) -> None:
        started = [0.0]

        def before(_module, _args):
            started[0] = time.perf_counter()

        def after(_module, _args, _out):
            self.seconds[kind] += time.perf_counter() - started[0]
        module.register_forward_pre_hook(before)
        module.register_forward_hook(after)

    def parts_ms(self, total_s: float, calls: int) -> dict[str, float]:
        s = {k: v / calls for k, v in self.seconds.items()}
        attention = s.pop("attention_with_projections", 0.0) - s.get("qkv_proj", 0.0) \
            - s.get("o_proj", 0.0)
        parts = {**{k: s.get(k, 0.0) for k in (*FAMILIES, "lm_head")}, "attention": attention}
        parts["rest"] = total_s - sum(parts.values())
        return {k: round(v * 1e3, 2) for k, v in parts.items()}


def decode_items(runner: ModelRunner, batch: int, context: int) -> list[SeqStep]:
    per_seq = -(-context // runner.block_size)
    return [SeqStep([(17 * b) % runner.config.vocab_size], context - 1,
                    list(range(b * per_seq, (b + 1) * per_seq)), True) for b in range(batch)]


def prefill_items(runner: ModelRunner, chunk: int) -> list[SeqStep]:
    per_seq = -(-chunk // runner.block_size)
    tokens = [(31 * i) % runner.config.vocab_size for i in range(chunk)]
    return [SeqStep(tokens, 0, list(range(per_seq)), True)]


def sample_ms(logits: torch.Tensor, repeats: int) -> float:
    """The worker's sampler over a step's logits (the model's own: how peaked they are decides
    how wide top_p's candidates get), greedy and temperature 0.7 / top_p 0.9 rows alternating."""
    from pagedserve.pipeline.sampling_params import SamplingParams
    from pagedserve.workers.sampler import Sampler
    sampler = Sampler(seed=0)
    batch = logits.shape[0]
    params = [SamplingParams(temperature=0.0) if i % 2 == 0 else
              SamplingParams(temperature=0.7, top_p=0.9) for i in range(batch)]
    tokens = [[1, 2, 3]] * batch
    return timed(lambda: sampler(logits, params, tokens, [2] * batch), repeats) * 1e3


def weight_bytes(runner: ModelRunner) -> int:
    """Bytes one decode step reads of the weights: every linear as stored, the LM head too."""
    return sum(m.quantized.nbytes if m.quantized is not None
               else m.weight.numel() * m.weight.element_size()
               for m in runner.model.modules() if isinstance(m, PackableLinear))


def read_gb_s(mib: int) -> float:
    """This host's streaming read bandwidth over `mib` MiB (a sum on torch's threads, the
    threads the step runs on): what one decode step's weights are read at, at best."""
    src = torch.empty(mib << 18, dtype=torch.float32)
    src.fill_(1.0)
    seconds = timed(lambda: src.sum(), repeats=5)
    return src.nbytes / seconds / 1e9


def copy_gb_s(mib: int) -> float:
    """This host's copy bandwidth (read + write) over `mib` MiB, well past its caches."""
    src = torch.empty(mib << 18, dtype=torch.float32)
    dst = torch.empty_like(src)
    src.fill_(1.0)
    seconds = timed(lambda: dst.copy_(src), repeats=5)
    return 2 * src.nbytes / seconds / 1e9   # read + write


REPLAY_KINDS = {1: "rms_norm", 2: "silu_mul", 3: "gguf_linear", 4: "gguf_packed",
                5: "linear_f32", 6: "linear_q8", 7: "rope_store", 8: "decode_attention",
                9: "add_rows"}   # kernels/native_replay.py's op kinds


def replay_ms(runner: ModelRunner, items: list[SeqStep], repeats: int, step_s: float) -> dict:
    """The serving step's native calls by kind (a replayed decode step times each call), and
    the rest of the step (Python around the replay: embedding, sampling inputs, outputs)."""
    replay = runner.cpu_replay
    replay.seconds = np.zeros(OP_KINDS)
    try:
        for _ in range(repeats):
            runner.execute(items)
        seconds = replay.seconds / repeats
    finally:
        replay.seconds = None
    if not seconds.any():
        return {}   # this step did not replay (too many rows, or a prefill)
    parts = {name: round(float(seconds[kind]) * 1e3, 3) for kind, name in REPLAY_KINDS.items()
             if seconds[kind]}
    parts["outside_native_calls"] = round((step_s - float(seconds.sum())) * 1e3, 3)
    return parts


def profile(runner: ModelRunner, items: list[SeqStep], repeats: int) -> dict:
    step_s = timed(lambda: runner.execute(items), repeats)
    native_parts = replay_ms(runner, items, repeats, step_s) if runner.cpu_replay else {}
    replay, runner.cpu_replay = runner.cpu_replay, None
    try:
        eager_s = timed(lambda: runner.execute(items), repeats)
        hooks = Hooks(runner.model)
        runner.execute(items)                            # warm the hooks
        hooks.seconds.clear()
        start = time.perf_counter()
        for _ in range(repeats):
            runner.execute(items)
        traced_s = (time.perf_counter() - start) / repeats
        parts = hooks.parts_ms(traced_s, repeats)
    finally:
        runner.cpu_replay = replay
        runner.model.__dict__.pop("compute_logits", None)
        for module in runner.model.modules():
            module._forward_hooks.clear()
            module._forward_pre_hooks.clear()
    return {"step_ms": round(step_s * 1e3, 2), **({"replay_ms": native_parts} if native_parts
                                                  else {}),
            "eager_ms": round(eager_s * 1e3, 2),
            "traced_ms": round(traced_s * 1e3, 2), "parts_ms": parts}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=ModelArgs().model)
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--copy-mib", type=int, default=1024,
                        help="the buffer the read (floor_ms) and copy bandwidths are measured over")
    bench_record.add_no_store_flag(parser)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    model_dir = resolve_model(args.model)
    config = load_config(model_dir)
    blocks = max(max(batches) * -(-args.context // 16), -(-args.prefill_chunk // 16))
    runner = ModelRunner(config, model_dir, getattr(torch, args.dtype), "cpu", 16, blocks,
                         quantization=args.quantization)
    for layer in runner.kv_cache:   # random K/V: attention's cost does not depend on them
        layer.copy_(to_storage(torch.randn(layer.shape), layer.dtype))
    bandwidth = read_gb_s(args.copy_mib)
    weights = weight_bytes(runner)
    report = {"model": args.model, "dtype": args.dtype, "quantization": runner.quantization,
              "context": args.context, "threads": torch.get_num_threads(),
              "native_variant": native.variant(), **cpu_info(),
              "read_gb_s": round(bandwidth, 1), "copy_gb_s": round(copy_gb_s(args.copy_mib), 1),
              "weight_mb": round(weights / 2**20, 1),
              "floor_ms": float(f"{weights / (bandwidth * 1e9) * 1e3:.4g}")}   # tiny models too
    for batch in batches:
        repeats = max(3, int(30 / batch ** 0.5))
        shape = profile(runner, decode_items(runner, batch, args.context), repeats)
        logits = runner.execute(decode_items(runner, batch, args.context)).clone()
        shape["sample_ms"] = round(sample_ms(logits, repeats), 2)
        report[f"decode_b{batch}"] = shape
        print(f"decode batch {batch}: {shape}", file=sys.stderr)
    shape = profile(runner, prefill_items(runner, args.prefill_chunk), 3)
    report[f"prefill_{args.prefill_chunk}"] = shape
    print(f"prefill chunk {args.prefill_chunk}: {shape}", file=sys.stderr)
    if 1 in batches:
        report["b1_share_of_floor"] = float(
            f"{report['floor_ms'] / report['decode_b1']['step_ms']:.3g}")
    bench_record.finish("profile_step", report, args.no_store, argv)
    return report


if __name__ == "__main__":
    main()
