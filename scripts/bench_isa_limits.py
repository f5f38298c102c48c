"""How close the AVX2 GGUF kernels run to what their own instruction mix allows, on one core.

For each type the default model's 64-row step spends most in (Q5_0: q/k/o/gate/up, Q6_K: half of
down, Q8_0: the LM head), two rates in G MAC/s (multiply-adds a second), one thread, AVX2:
- `loop`: the wide pass's inner loop (scripts/isa_limits.c: the same instructions a half panel
  and 4 rows of x take, block terms included) on data that stays in L1 - no weight stream, no
  panel spreading, no call or thread overhead;
- `kernel`: kernels/native_linear_gguf.py's packed linear (the AVX2 build,
  PAGEDSERVE_NATIVE_VARIANT=avx2) at the model's shape and 64 rows, random weights.
`kernel_share` = kernel / loop: what is left to gain without changing the instructions.
`int16_loop` is the Q8_0 alternative with vpmaddwd on int16 weights (its weights twice as
large), for comparison with `q8_0`'s loop. Best of `--repeats`, alternated. x86-64 with a C
compiler only. The last line is one JSON object, stored under benchmarks/results/bench_isa_limits/.
"""
from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_record  # noqa: E402

from pagedserve.kernels import native, native_linear_gguf as gl  # noqa: E402
from pagedserve.kernels.native import build  # noqa: E402
from pagedserve.kernels.quant_formats import BLOCKS, QType, QuantizedWeight  # noqa: E402

MACS_PER_ITER = 1024          # each loop iteration: 32 k x 8 columns x 4 rows
# loop: (type, rows of W, k, where each block's fp16 scale is) - the default model's shapes
SHAPES = {"q5_0": (QType.Q5_0, 9728, 896, 0), "q6_k": (QType.Q6_K, 896, 4864, 208),
          "q8_0": (QType.Q8_0, 151936, 896, 0)}


def compile_loops(directory: Path) -> dict:
    """The loops of isa_limits.c by name, each `fn(iterations) -> checksum`."""
    compiler = build.find_compiler()
    if compiler is None:
        raise SystemExit("bench_isa_limits: no C compiler")
    out = directory / "isa_limits.so"
    subprocess.run([compiler, "-O3", "-fPIC", "-shared", *build.variant_flags(compiler, "avx2"),
                    "-o", str(out), str(Path(__file__).with_name("isa_limits.c"))], check=True)
    lib = ctypes.CDLL(str(out))
    lib.isa_limits_init()
    loops = {}
    for name in (*SHAPES, "int16"):
        fn = loops[name] = getattr(lib, f"isa_limits_{name}")
        fn.restype, fn.argtypes = ctypes.c_float, (ctypes.c_long,)
    return loops


def loop_rate(fn, iters: int) -> float:
    started = time.perf_counter()
    fn(iters)
    return iters * MACS_PER_ITER / (time.perf_counter() - started) / 1e9


def random_weight(qtype: QType, n: int, k: int, scale_at: int, gen: torch.Generator
                  ) -> QuantizedWeight:
    """Random bytes, each block's fp16 scale set to a small normal value."""
    elements, nbytes = BLOCKS[qtype]
    raw = torch.randint(0, 256, (n, k // elements, nbytes), dtype=torch.uint8, generator=gen)
    half = (torch.randn(n, k // elements, generator=gen) * 1e-3).half()
    raw[..., scale_at:scale_at + 2] = half.view(torch.uint8).view(n, k // elements, 2)
    return QuantizedWeight(qtype, raw.view(n, -1).contiguous(), k)


def kernel_rate(bound: gl.BoundLinear, x: torch.Tensor, out: torch.Tensor) -> float:
    started = time.perf_counter()
    bound(x, out, 1)
    return x.shape[0] * bound.n * bound.k / (time.perf_counter() - started) / 1e9


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--iters", type=int, default=1_000_000, help="loop iterations a timing")
    bench_record.add_no_store_flag(parser)
    args = parser.parse_args(argv)
    if build.machine() != "x86_64":
        raise SystemExit("bench_isa_limits: x86-64 only (the loops are AVX2)")
    native.select_variant("avx2")
    gen = torch.Generator().manual_seed(0)
    report: dict = {"rows": args.rows, "threads": 1, "native_variant": "avx2", "unit": "G MAC/s"}
    with tempfile.TemporaryDirectory() as tmp:
        loops = compile_loops(Path(tmp))
        for name, (qtype, n, k, scale_at) in SHAPES.items():
            bound = gl.BoundLinear(gl.pack(random_weight(qtype, n, k, scale_at, gen)))
            x, out = torch.randn(args.rows, k, generator=gen), torch.empty(args.rows, n)
            bound(x, out, 1)
            loop = kernel = 0.0
            for _ in range(args.repeats):       # alternated: both see the same host
                loop = max(loop, loop_rate(loops[name], args.iters))
                kernel = max(kernel, kernel_rate(bound, x, out))
            report[name] = {"shape": f"{n}x{k}", "loop": round(loop, 1), "kernel": round(kernel, 1),
                            "kernel_share": round(kernel / loop, 3)}
            print(f"{name} {n}x{k}, {args.rows} rows: loop {loop:.1f}, kernel {kernel:.1f} "
                  f"G MAC/s ({kernel / loop:.0%})", file=sys.stderr)
        report["int16_loop"] = round(max(loop_rate(loops["int16"], args.iters)
                                         for _ in range(args.repeats)), 1)
    bench_record.finish("bench_isa_limits", report, args.no_store, argv)
    return report


if __name__ == "__main__":
    main()
