"""Decode step time of our model runner vs. the bf16 matmul roofline and transformers' forward.

For batch sizes 1, 16, 64, 256 at a context of 512 tokens (bf16, CPU by default; `--device cuda`
times the Triton path on a GPU): every sequence
owns its own blocks (no sharing, so attention really reads B x 512 tokens of K/V), the cache is
filled with random K/V (attention cost does not depend on the values), and each timed step
recomputes the token at position context-1 (same work every step). A step is the runner's whole
`execute`: tensor preparation, forward, logits of every row (sampling excluded).

Roofline: bf16 matmuls of the model's own linear shapes at M = 256 tokens give FLOP/s (the faster
of torch's F.linear and the engine's own prepacked linear), and tokens/s at that rate = FLOP/s /
(2 x matmul parameters). The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from pathlib import Path

import torch


from pagedserve.kernels import native_decode_attention  # noqa: E402
from pagedserve.kernels.kv_format import KV_CACHE_DTYPES, resolve_kv_cache_dtype, to_storage  # noqa: E402
from pagedserve.workers.loader import DEFAULT_MODEL, load_config, resolve_model  # noqa: E402
from pagedserve.workers.model_runner import ModelRunner, SeqStep  # noqa: E402


def timed(fn, repeats: int, warmup: int = 2, device: str = "cpu") -> float:
    """Median seconds per call (on a GPU, each call waits for the device's work to finish)."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cpu_info() -> dict:
    """What decides the CPU figures, for comparing runs across hosts: torch's vector ISA, whether
    oneDNN multiplies bf16 natively (else bf16 matmuls are emulated) and the dtype `--dtype auto`
    serves."""
    from pagedserve.workers.models.layers import bf16_prepack_supported
    from pagedserve.workers.build import resolve_dtype
    return {"cpu_isa": torch.backends.cpu.get_cpu_capability(),
            "bf16_packed": bf16_prepack_supported(),
            "auto_dtype": str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")}


def linear_shapes(config) -> list[tuple[int, int, int]]:
    """(in, out, count) of every matmul in one forward, the LM head included."""
    h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * d
    layers = config.num_hidden_layers
    return [(h, qkv, layers), (config.num_attention_heads * d, h, layers), (h, 2 * inter, layers),
            (inter, h, layers), (h, config.vocab_size, 1)]


def matmul_rates(config, tokens: int, dtype: torch.dtype,
                 device: str = "cpu") -> tuple[float, float, int]:
    """(F.linear FLOP/s, the engine's linear FLOP/s, matmul parameters) at `tokens` rows.

    The roofline is the faster of the two: torch's own product, or the engine's (PackableLinear,
    prepacked as the model runner does: on CPUs without AVX-512 the native fp32 kernel, which
    beats MKL there), so a step is never measured against a slower product than the one it runs."""
    from pagedserve.workers.models.layers import PackableLinear

    shapes = linear_shapes(config)
    params = sum(i * o * c for i, o, c in shapes)
    x = {i: torch.randn(tokens, i, dtype=dtype, device=device) for i, _, _ in shapes}
    w = {(i, o): torch.randn(o, i, dtype=dtype, device=device) for i, o, _ in shapes}
    engine = {}
    for (i, o), weight in w.items():
        engine[(i, o)] = layer = PackableLinear()
        layer.weight = torch.nn.Parameter(weight, requires_grad=False)
        layer.prepack()

    def one_forward_of_matmuls(linear):
        def run():
            for i, o, count in shapes:
                for _ in range(count):
                    linear(x[i], (i, o))
        return run

    torch_s = timed(one_forward_of_matmuls(lambda a, key: torch.nn.functional.linear(a, w[key])),
                    repeats=5, device=device)
    engine_s = timed(one_forward_of_matmuls(lambda a, key: engine[key].matmul(a)),
                     repeats=5, device=device)
    return 2 * tokens * params / torch_s, 2 * tokens * params / engine_s, params


def bench_runner(runner: ModelRunner, batch: int, context: int, repeats: int) -> float:
    blocks_per_seq = -(-context // runner.block_size)
    items = [SeqStep([(17 * b) % runner.config.vocab_size], context - 1,
                     list(range(b * blocks_per_seq, (b + 1) * blocks_per_seq)), True)
             for b in range(batch)]
    return timed(lambda: runner.execute(items), repeats, device=str(runner.device))


def bench_hf(model_dir: Path, random_weights: bool, config, context: int, dtype: torch.dtype,
             repeats: int, device: str = "cpu") -> float:
    """transformers' forward of one token at batch 1 over a `context - 1` token cache."""
    from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

    if random_weights:
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    hf.to(device).eval()
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prompt = torch.randint(0, config.vocab_size, (1, context - 1), device=device)
        cache = DynamicCache(config=hf.config)
        hf(input_ids=prompt, past_key_values=cache, use_cache=True)
        token = torch.tensor([[42]], device=device)

        # The cache grows by one token per call (511 -> ~533): negligible next to 512, and
        # cropping it back would add work to transformers' side of the comparison.
        return timed(lambda: hf(input_ids=token, past_key_values=cache, use_cache=True), repeats,
                     device=device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--random-weights", action="store_true",
                        help="skip loading: random weights of the model's real shapes")
    parser.add_argument("--batch-sizes", default="1,16,64,256")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--attention-threads", type=int, default=0,
                        help="threads of the native CPU decode kernel (0: same as --threads)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (Triton kernels)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="cuda: no CUDA graphs (default: decode steps replay captured graphs)")
    parser.add_argument("--quantization", default="none", choices=["none", "int8"],
                        help="int8: the engine's int8 linears (CPU, --dtype float32); the "
                             "roofline stays the dtype's matmul roofline")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                        help="KV cache storage (auto: --dtype); fp8 reads a quarter of fp32's bytes")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    native_decode_attention.set_threads(args.attention_threads)
    dtype = getattr(torch, args.dtype)
    batches = [int(b) for b in args.batch_sizes.split(",")]

    device = args.device
    config_only = args.random_weights and Path(args.model, "config.json").is_file()
    model_dir = Path(args.model) if config_only else resolve_model(args.model)
    config = load_config(model_dir)
    blocks_per_seq = -(-args.context // args.block_size)
    cache_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, dtype)
    runner = ModelRunner(config, None if args.random_weights else model_dir, dtype, device,
                         args.block_size, max(batches) * blocks_per_seq,
                         kv_cache_dtype=cache_dtype,
                         cuda_graph_batch=0 if args.enforce_eager else max(batches),
                         quantization=args.quantization)
    for layer in runner.kv_cache:  # random K/V (fp8 has no normal_), a layer at a time
        layer.copy_(to_storage(torch.randn(layer.shape), cache_dtype))

    torch_flops, engine_flops, params = matmul_rates(config, max(batches), dtype, device)
    flops = max(torch_flops, engine_flops)
    roofline = flops / (2 * params)
    print(f"matmul roofline: {flops / 1e9:.0f} GFLOP/s (F.linear {torch_flops / 1e9:.0f}, the "
          f"engine's linear {engine_flops / 1e9:.0f}) over {params / 1e6:.1f}M matmul "
          f"parameters -> {roofline:.0f} tok/s   (threads {torch.get_num_threads()})")
    report = {"model": args.model, "dtype": args.dtype, "quantization": args.quantization,
              "context": args.context,
              "kv_cache_dtype": str(cache_dtype).removeprefix("torch."),
              "threads": torch.get_num_threads(), "attention_threads": args.attention_threads,
              "matmul_gflops": round(flops / 1e9, 1),
              "matmul_gflops_torch": round(torch_flops / 1e9, 1),
              "matmul_gflops_engine": round(engine_flops / 1e9, 1),
              "roofline_tok_s": round(roofline, 1), "device": device,
              "cuda_graphs": runner.decode_graphs is not None,
              **(cpu_info() if device == "cpu" else
                 {"device_name": torch.cuda.get_device_name(torch.device(device))})}
    for batch in batches:
        seconds = bench_runner(runner, batch, args.context, repeats=max(3, int(40 / batch ** 0.5)))
        report[f"step_ms_b{batch}"] = round(seconds * 1e3, 2)
        report[f"decode_tok_s_b{batch}"] = round(batch / seconds, 1)
        print(f"batch {batch:4d}: step {seconds * 1e3:8.2f} ms  {batch / seconds:8.1f} tok/s  "
              f"({100 * batch / seconds / roofline:5.1f}% of roofline)")
    hf_seconds = bench_hf(model_dir, args.random_weights, config, args.context, dtype,
                          repeats=20, device=device)
    report["hf_step_ms_b1"] = round(hf_seconds * 1e3, 2)
    report["hf_tok_s_b1"] = round(1 / hf_seconds, 1)
    print(f"transformers batch 1: step {hf_seconds * 1e3:.2f} ms  {1 / hf_seconds:.1f} tok/s")
    if 1 in batches:
        report["b1_step_vs_hf"] = round(report["step_ms_b1"] / report["hf_step_ms_b1"], 2)
    if 256 in batches:
        report["b256_of_roofline"] = round(report["decode_tok_s_b256"] / roofline, 3)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
