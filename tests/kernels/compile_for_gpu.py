"""Compile every Triton kernel for a CUDA GPU without one: IR -> PTX -> cubin with the ptxas that
ships in triton's wheel. The interpreter (TRITON_INTERPRET=1) runs the kernels as numpy and
cannot see what only the compiler rejects (layouts, dot shapes, loop forms, shared memory), so
this catches it on CPU-only CI. Run by test_kernel_triton.py in a subprocess (triton must be
imported without TRITON_INTERPRET); prints one line per compiled variant.

    python tests/kernels/compile_for_gpu.py [ARCH ...]     # default 90 (Hopper); 80: Ampere
"""
from __future__ import annotations

import importlib
import itertools
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
    decode = importlib.import_module("pagedserve.kernels.paged_decode_attention")
    prefill = importlib.import_module("pagedserve.kernels.paged_prefill_attention")
    store = importlib.import_module("pagedserve.kernels.store_kv")
    copy = importlib.import_module("pagedserve.kernels.copy_blocks")
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


def main(archs: list[int]) -> int:
    failures = 0
    for arch in archs:
        target = GPUTarget("cuda", arch, 32)
        for name, fn, ptrs, constexprs in variants():
            sig = signature(fn, ptrs, constexprs)
            try:
                compiled = triton.compile(ASTSource(fn, sig, constexprs), target=target)
                assert compiled.asm.get("cubin"), "no cubin"
                shared, limit = compiled.metadata.shared, SHARED_LIMIT.get(arch)
                assert limit is None or shared <= limit, (
                    f"{shared} B of shared memory, over sm_{arch}'s {limit}")
                print(f"sm_{arch} {name}: ok ({compiled.metadata.shared} B shared memory)")
            except Exception as e:  # report every failing variant, not just the first
                failures += 1
                print(f"sm_{arch} {name}: FAILED {type(e).__name__}: {str(e)[:2000]}")
    print(f"{failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main([int(a) for a in sys.argv[1:]] or [90]))
