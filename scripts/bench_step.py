"""Decode step time of our model runner vs. the roofline of its matmuls and transformers' forward.

For batch sizes 1, 16, 64, 256 at a context of 512 tokens (bf16, CPU by default; `--device cuda`
times the Triton path on a GPU): every sequence
owns its own blocks (no sharing, so attention really reads B x 512 tokens of K/V), the cache is
filled with random K/V (attention cost does not depend on the values), and each timed step
recomputes the token at position context-1 (same work every step). A step is the runner's whole
`execute`: tensor preparation, forward, logits of every row (sampling excluded).

Roofline: the matmuls of the model's own linear shapes at M = 256 tokens (the largest batch),
in the arithmetic the step actually runs, give FLOP/s, and tokens/s at that rate = FLOP/s /
(2 x matmul parameters). Without --quantization that is --dtype's product (the faster of torch's
F.linear and the engine's own prepacked linear); with `--quantization int8` it is the engine's
int8 linear (kernels/native_linear_q8.py, as the runner quantizes it), since an int8 step
measured against the fp32 product would flatter it. The JSON's `roofline` names the one used.
The last line is one JSON object, stored under benchmarks/results/bench_step/
(scripts/bench_record.py) unless --no-store.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_record  # noqa: E402

from pagedserve.kernels import native_decode_attention  # noqa: E402
from pagedserve.kernels.kv_format import KV_CACHE_DTYPES, resolve_kv_cache_dtype, to_storage  # noqa: E402
from pagedserve.workers.loader import TEST_MODEL, load_config, resolve_model  # noqa: E402
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


def matmul_rates(config, tokens: int, dtype: torch.dtype, device: str = "cpu",
                 quantization: str = "none") -> dict:
    """FLOP/s of one forward's matmuls at `tokens` rows: {"torch": F.linear, "engine": the
    engine's linear (PackableLinear, prepacked as the model runner does: on CPUs without AVX-512
    the native fp32 kernel, which beats MKL there), "params": matmul parameters}, and with
    quantization int8 also "int8": the engine's linears quantized as the runner quantizes them
    (kernels/native_linear_q8.py; a shape it cannot take stays on the engine's linear)."""
    from pagedserve.workers.models.layers import PackableLinear

    shapes = linear_shapes(config)
    params = sum(i * o * c for i, o, c in shapes)
    x = {i: torch.randn(tokens, i, dtype=dtype, device=device) for i, _, _ in shapes}
    w = {(i, o): torch.randn(o, i, dtype=dtype, device=device) for i, o, _ in shapes}

    def engine_linears(int8: bool) -> dict:
        layers = {}
        for (i, o), weight in w.items():
            layers[(i, o)] = layer = PackableLinear()
            layer.weight = torch.nn.Parameter(weight, requires_grad=False)
            if int8:
                layer.quantize_int8()
            layer.prepack()  # a no-op for a quantized layer, as in the runner
        return layers

    def one_forward_of_matmuls(linear):
        def run():
            for i, o, count in shapes:
                for _ in range(count):
                    linear(x[i], (i, o))
        return run

    def rate(linear) -> float:
        return 2 * tokens * params / timed(one_forward_of_matmuls(linear), repeats=5,
                                           device=device)

    rates = {"torch": rate(lambda a, key: torch.nn.functional.linear(a, w[key])),
             "params": params}
    engine = engine_linears(int8=False)
    rates["engine"] = rate(lambda a, key: engine[key].matmul(a))
    if quantization == "int8":
        engine = engine_linears(int8=True)
        rates["int8"] = rate(lambda a, key: engine[key].matmul(a))
    return rates


def roofline(rates: dict, dtype: torch.dtype, tokens: int, quantization: str
             ) -> tuple[float, str]:
    """(FLOP/s, what it is) of the arithmetic a step runs: int8's own rate under --quantization
    int8, else the faster of F.linear and the engine's linear in `dtype`."""
    if quantization == "int8":
        return rates["int8"], f"int8 linears (kernels/native_linear_q8.py) at {tokens} rows"
    name = str(dtype).removeprefix("torch.")
    return (max(rates["torch"], rates["engine"]),
            f"{name} matmuls at {tokens} rows (the faster of F.linear and the engine's linear)")


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
        from pagedserve.workers.testing import hf_model
        hf = hf_model.__wrapped__(model_dir).to(dtype)   # uncached: converted here
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


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=TEST_MODEL)
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
                        help="int8: the engine's int8 linears (CPU, --dtype float32), "
                             "measured against the int8 linear's roofline")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                        help="KV cache storage (auto: --dtype); fp8 reads a quarter of fp32's bytes")
    parser.add_argument("--skip-hf", action="store_true", help="no transformers step")
    bench_record.add_no_store_flag(parser)
    args = parser.parse_args(argv)
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

    rates = matmul_rates(config, max(batches), dtype, device, args.quantization)
    flops, roofline_name = roofline(rates, dtype, max(batches), args.quantization)
    params = rates["params"]
    roofline_tok_s = flops / (2 * params)
    int8 = f", int8 linear {rates['int8'] / 1e9:.0f}" if "int8" in rates else ""
    print(f"roofline, {roofline_name}: {flops / 1e9:.0f} GFLOP/s (F.linear "
          f"{rates['torch'] / 1e9:.0f}, the engine's linear {rates['engine'] / 1e9:.0f}{int8}) "
          f"over {params / 1e6:.1f}M matmul parameters -> {roofline_tok_s:.0f} tok/s   "
          f"(threads {torch.get_num_threads()})")
    report = {"model": args.model, "dtype": args.dtype, "quantization": args.quantization,
              "context": args.context,
              "kv_cache_dtype": str(cache_dtype).removeprefix("torch."),
              "threads": torch.get_num_threads(), "attention_threads": args.attention_threads,
              "roofline": roofline_name, "matmul_gflops": round(flops / 1e9, 1),
              "matmul_gflops_torch": round(rates["torch"] / 1e9, 1),
              "matmul_gflops_engine": round(rates["engine"] / 1e9, 1),
              **({"matmul_gops_int8": round(rates["int8"] / 1e9, 1)} if "int8" in rates else {}),
              "roofline_tok_s": round(roofline_tok_s, 1), "device": device,
              "cuda_graphs": runner.decode_graphs is not None,
              **(cpu_info() if device == "cpu" else
                 {"device_name": torch.cuda.get_device_name(torch.device(device))})}
    for batch in batches:
        seconds = bench_runner(runner, batch, args.context, repeats=max(3, int(40 / batch ** 0.5)))
        report[f"step_ms_b{batch}"] = round(seconds * 1e3, 2)
        report[f"decode_tok_s_b{batch}"] = round(batch / seconds, 1)
        print(f"batch {batch:4d}: step {seconds * 1e3:8.2f} ms  {batch / seconds:8.1f} tok/s  "
              f"({100 * batch / seconds / roofline_tok_s:5.1f}% of roofline)")
    if not args.skip_hf:
        hf_seconds = bench_hf(model_dir, args.random_weights, config, args.context, dtype,
                              repeats=20, device=device)
        report["hf_step_ms_b1"] = round(hf_seconds * 1e3, 2)
        report["hf_tok_s_b1"] = round(1 / hf_seconds, 1)
        print(f"transformers batch 1: step {hf_seconds * 1e3:.2f} ms  {1 / hf_seconds:.1f} tok/s")
        if 1 in batches:
            report["b1_step_vs_hf"] = round(report["step_ms_b1"] / report["hf_step_ms_b1"], 2)
    largest = max(batches)
    report[f"b{largest}_of_roofline"] = round(report[f"decode_tok_s_b{largest}"] / roofline_tok_s,
                                              3)
    bench_record.finish("bench_step", report, args.no_store, argv)
    return report


if __name__ == "__main__":
    main()
