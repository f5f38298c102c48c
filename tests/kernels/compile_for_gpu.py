"""Compile every Triton kernel for a CUDA GPU without one: IR -> PTX -> cubin with the ptxas that
ships in triton's wheel. The interpreter (TRITON_INTERPRET=1) runs the kernels as numpy and
cannot see what only the compiler rejects (layouts, dot shapes, loop forms, shared memory), so
this catches it on CPU-only CI. Run by test_kernel_triton.py in a subprocess (triton must be
imported without TRITON_INTERPRET); prints one line per compiled variant. The variants compile in
parallel, one process per CPU (each process builds the list of variants itself and compiles the
ones whose index it is given: kernels do not pickle).

    python tests/kernels/compile_for_gpu.py [ARCH ...] [--all]   # default 90 (Hopper); 80: Ampere
"""
from __future__ import annotations

import concurrent.futures
import importlib
import itertools
import os
import sys

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pagedserve.kernels._checks import kv_tile_tokens  # noqa: E402
from pagedserve.kernels.kv_format import triton_format  # noqa: E402

ACT = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}
# (activation dtype, cache storage type, cache torch dtype)
CACHES = [("bf16", "bf16", torch.bfloat16), ("fp32", "fp32", torch.float32),
          ("bf16", "u8", torch.float8_e4m3fn)]
BLOCK_SIZES = (16, 128)   # the smallest tiles and the largest (most shared memory)
# head sizes: 64 at every block size, 256 (Gemma's) at the largest, where fp32 tiles are cut to
# fit shared memory (kernels/_checks.py: kv_tile_tokens)
HEAD_DIMS = {16: (64,), 128: (64, 256)}
ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# the most shared memory a block may use, by architecture (sm_90: 227 KB, sm_80: 163 KB)
SHARED_LIMIT = {90: 232448, 80: 166912}


def signature(fn, pointers: dict[str, str], constexprs: dict) -> dict[str, str]:
    """Every runtime argument: pointers as given, scale_log2e fp32, the rest i32."""
    return {name: "*" + pointers[name] if name in pointers
            else "fp32" if name == "scale_log2e" else "i32"
            for name in fn.arg_names if name not in constexprs}


def _attention_variants(decode, prefill, act, cache, fmt, block_size, head_dim):
    """Decode (whole, and split at head size 64) and prefill with the tiles their wrappers pick
    for this shape."""
    dot = "ieee" if act == "fp32" else "tf32"
    shape = f"bs{block_size}" + ("" if head_dim == 64 else f" d{head_dim}")
    for split in (False, True) if head_dim == 64 else (False,):   # split: the same tiles
        ptrs = dict(q_ptr=act, k_cache_ptr=cache, v_cache_ptr=cache, block_tables_ptr="i32",
                    context_lens_ptr="i32", out_ptr=act, part_out_ptr="fp32", part_ml_ptr="fp32")
        yield (f"decode {act}/{cache} {shape}{' split' if split else ''}",
               decode._paged_decode_kernel, ptrs,
               dict(BLOCK_SIZE=block_size,
                    BLOCK_N=decode._tile_tokens(block_size, head_dim, ELEMENT_BYTES[act]),
                    BLOCK_G=16, BLOCK_D=head_dim, SPLIT=split, DOT_PRECISION=dot, KV_FORMAT=fmt,
                    DTYPE=ACT[act]))
    ptrs = dict(q_ptr=act, k_cache_ptr=cache, v_cache_ptr=cache, block_tables_ptr="i32",
                cu_seqlens_ptr="i32", context_lens_ptr="i32", out_ptr=act)
    yield (f"prefill {act}/{cache} {shape}", prefill._paged_prefill_kernel, ptrs,
           dict(BLOCK_M=32, BLOCK_SIZE=block_size,
                BLOCK_N=kv_tile_tokens(block_size, head_dim, ELEMENT_BYTES[act]),
                BLOCK_D=head_dim, DOT_PRECISION=dot, KV_FORMAT=fmt, DTYPE=ACT[act]))


def variants():
    decode = importlib.import_module("pagedserve.kernels.triton_decode_attention")
    prefill = importlib.import_module("pagedserve.kernels.triton_prefill_attention")
    store = importlib.import_module("pagedserve.kernels.triton_store_kv")
    copy = importlib.import_module("pagedserve.kernels.triton_copy_blocks")
    for (act, cache, cache_dtype), block_size in itertools.product(CACHES, BLOCK_SIZES):
        for head_dim in HEAD_DIMS[block_size]:
            yield from _attention_variants(decode, prefill, act, cache, triton_format(cache_dtype),
                                           block_size, head_dim)
    for act in ACT:
        yield (f"decode reduce -> {act}", decode._paged_decode_reduce_kernel,
               dict(part_out_ptr="fp32", part_ml_ptr="fp32", out_ptr=act),
               dict(BLOCK_G=16, BLOCK_P=16, BLOCK_D=64))
    yield ("decode reduce -> bf16 d256", decode._paged_decode_reduce_kernel,
           dict(part_out_ptr="fp32", part_ml_ptr="fp32", out_ptr="bf16"),
           dict(BLOCK_G=16, BLOCK_P=16, BLOCK_D=256))
    for cache in ("bf16", "fp32", "u8"):
        yield (f"store_kv -> {cache}", store._store_kv_kernel,
               dict(key_ptr=cache, value_ptr=cache, k_cache_ptr=cache, v_cache_ptr=cache,
                    slot_ptr="i64"), dict(BLOCK_H=4, BLOCK_D=64))
        yield (f"copy_blocks {cache}", copy._copy_blocks_kernel,
               dict(cache_ptr=cache, mapping_ptr="i64"), dict(CHUNK=1024))


def _quant_linear_variants():
    """Every weight type at the decode tile (BLOCK_M 16) with bf16 activations (an fp32 dot) and
    at the largest tile (BLOCK_M 64) with fp16 (an fp16 dot), fp32 activations once, and I4G
    with desc_act's permutation; with ALL_DTYPES (--all), every type with every dtype."""
    module = importlib.import_module("pagedserve.kernels.triton_quant_linear")
    qtypes = importlib.import_module("pagedserve.kernels.quant_formats").QType
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if ALL_DTYPES:
        cases = [(qtype, act, 16, False) for qtype in qtypes for act in dtypes]
        cases += [(qtype, "bf16", 64, False) for qtype in qtypes]
    else:
        cases = [(qtype, "bf16", 16, False) for qtype in qtypes]
        cases += [(qtype, "fp16", 64, False) for qtype in qtypes]
        cases += [(qtypes.Q4_K, "fp32", 16, False)]
    cases += [(qtypes.I4G, "fp16", 16, True)]
    for qtype, act, block_m, perm in cases:
        dot_dtype, precision = module.dot_operands(dtypes[act])
        _, block_n, block_k = module.tiles(block_m, 256)
        yield (f"quant_linear {qtype.name} {act} m{block_m}{' perm' if perm else ''}",
               module._quant_linear_kernel,
               dict(x_ptr=act, w_ptr="u8", perm_ptr="i64" if perm else "u8", y_ptr=act),
               dict(QTYPE=int(qtype), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                    HAS_PERM=perm, DOT_DTYPE=dot_dtype, DOT_PRECISION=precision))


def _lora_variants():
    """LoRA's segmented shrink and expand (kernels/triton_lora.py) in each activation dtype, at
    the tiles the wrappers use."""
    module = importlib.import_module("pagedserve.kernels.triton_lora")
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    for act, dtype in dtypes.items():
        precision = module.dot_precision(dtype)
        segs = dict(rows_ptr="i64", starts_ptr="i64", slots_ptr="i64")
        yield (f"lora shrink {act}", module._sgmv_shrink_kernel,
               dict(x_ptr=act, a_ptr=act, y_ptr=act, **segs),
               dict(BLOCK_M=module.BLOCK_M, BLOCK_R=module.BLOCK_R, BLOCK_K=module.BLOCK_K,
                    DOT_PRECISION=precision))
        yield (f"lora expand {act}", module._sgmv_expand_kernel,
               dict(y_ptr=act, b_ptr=act, out_ptr=act, **segs),
               dict(BLOCK_M=module.BLOCK_M, BLOCK_R=module.BLOCK_R, BLOCK_N=module.BLOCK_N,
                    DOT_PRECISION=precision))


def all_variants():
    yield from variants()
    yield from _quant_linear_variants()
    yield from _lora_variants()


def compile_variant(arch: int, index: int) -> tuple[str, bool]:
    """Compile variant `index` of all_variants() for sm_`arch`: (its report line, whether ok)."""
    name, fn, ptrs, constexprs = next(itertools.islice(all_variants(), index, None))
    sig = signature(fn, ptrs, constexprs)
    try:
        compiled = triton.compile(ASTSource(fn, sig, constexprs), target=GPUTarget("cuda", arch, 32))
        assert compiled.asm.get("cubin"), "no cubin"
        shared, limit = compiled.metadata.shared, SHARED_LIMIT.get(arch)
        assert limit is None or shared <= limit, (
            f"{shared} B of shared memory, over sm_{arch}'s {limit}")
        return f"sm_{arch} {name}: ok ({shared} B shared memory)", True
    except Exception as e:  # report every failing variant, not just the first
        return f"sm_{arch} {name}: FAILED {type(e).__name__}: {str(e)[:2000]}", False


def main(archs: list[int]) -> int:
    jobs = [(arch, index) for arch in archs for index in range(sum(1 for _ in all_variants()))]
    failures = 0
    with concurrent.futures.ProcessPoolExecutor(max_workers=os.cpu_count()) as pool:
        for line, ok in pool.map(compile_variant, *zip(*jobs)):   # in order, as they finish
            failures += not ok
            print(line, flush=True)
    print(f"{failures} failures")
    return 1 if failures else 0


ALL_DTYPES = "--all" in sys.argv   # read at import: the pool's workers import this module too

if __name__ == "__main__":
    sys.exit(main([int(a) for a in sys.argv[1:] if a != "--all"] or [90]))
