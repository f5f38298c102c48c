"""CPU decode attention over a paged KV cache: sequences bucketed by context length.

Same contract and the same numbers as paged_decode_attention_ref (it runs the same gather and
the same SDPA, row by row), but the reference pads every sequence to the batch's longest
context: in a ragged batch (contexts spread over 1..N) half of what it gathers and attends over
is padding. Here sequences are sorted by length and split into a few buckets whose lengths
differ by at most a factor BUCKET_RATIO; each bucket gathers and attends only up to its own
longest context. Few, large buckets keep each torch op one big parallel region.

Measured (2-core dev box shared with other jobs, load ~6.5, batch 256, contexts up to 512,
SmolLM2 heads, bf16, median process CPU time): one thread, ragged 38 -> 26 ms, equal lengths
35 -> 35 ms; two threads, ragged 62-75 -> 160 ms. With two threads on oversubscribed cores every
op's OpenMP barrier waits for a descheduled thread (tiny ops took 10-30 ms in the profiler), so
the few extra ops per bucket cost more than the padding saved. That is why this path is opt-in
(PAGEDSERVE_DECODE_CPU=bucketed, kernels/__init__.py) until it is measured on dedicated cores.

Tried and rejected: L2-sized chunks of ~8 sequences (no gain on equal lengths with one thread,
5x slower with two on the loaded box), torch.compile of a gather-free formulation (inductor does
fuse the block-table indirection, no [B, ctx, Hkv, D] buffer, but its per-score horizontal
reductions ran ~1.5x slower than the reference, after a ~75 s compile) and FlexAttention's CPU
template with the block table as its kv_indices (~20x slower, static shapes only).
"""
from __future__ import annotations

import bisect

import torch
import torch.nn.functional as F

from .attention_ref import decode_inputs, gather_pages

# A bucket holds the sequences whose block count is in (BUCKET_RATIO * top, top]; at most
# MAX_BUCKETS buckets, the last takes the rest. Padding is then under ~1/3 of the work.
BUCKET_RATIO = 0.6
MAX_BUCKETS = 4


def bucket_bounds(blocks_desc: list[int], ratio: float = BUCKET_RATIO,
                  max_buckets: int = MAX_BUCKETS) -> list[tuple[int, int]]:
    """(start, end) row ranges over block counts sorted in descending order."""
    negated = [-b for b in blocks_desc]
    bounds, start = [], 0
    while start < len(blocks_desc):
        end = len(blocks_desc)
        if len(bounds) < max_buckets - 1:
            limit = int(blocks_desc[start] * ratio)
            end = max(start + 1, bisect.bisect_left(negated, -limit))
        bounds.append((start, end))
        start = end
    return bounds


def paged_decode_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float, window: int = 0) -> torch.Tensor:
    """paged_decode_attention_ref's result, computed per bucket of similar context lengths
    (with a window: of similar spans from each row's first visible block).

    Every op here is one OpenMP region; on shared cores each costs ~1 ms of barrier waiting
    whatever its size, so the per-bucket work is kept to gather K, gather V and one SDPA.
    """
    inputs = decode_inputs(q, k_cache, v_cache, block_tables, context_lens, window)
    if inputs is None:
        return q.new_empty(q.shape)
    num_seqs, num_q_heads, head_dim, block_size, block_tables, first, context_lens = inputs
    lens_desc, order = torch.sort(context_lens, descending=True, stable=True)
    blocks_desc = [-(-n // block_size) for n in lens_desc.tolist()]
    bounds = bucket_bounds(blocks_desc)
    if len(bounds) > 1:
        q, block_tables, context_lens = q[order], block_tables[order], lens_desc
        first = None if first is None else first[order]
    positions = torch.arange(blocks_desc[0] * block_size, device=q.device)
    hidden = positions[None, :] >= context_lens[:, None]
    if first is not None:
        hidden |= positions[None, :] < first[:, None]
    # Additive mask (SDPA turns a bool mask into this on every call).
    mask = torch.zeros((), dtype=q.dtype, device=q.device).masked_fill(hidden, float("-inf"))
    outputs = []
    for start, end in bounds:
        rows, num_blocks = end - start, blocks_desc[start]
        tables = block_tables[start:end]
        keys = gather_pages(k_cache, tables, num_blocks, "decode_k").to(q.dtype)
        values = gather_pages(v_cache, tables, num_blocks, "decode_v").to(q.dtype)
        if first is not None:   # padding may hold anything (even NaN): zero, not just mask
            zero = hidden[start:end, :num_blocks * block_size, None, None]
            keys, values = keys.masked_fill(zero, 0), values.masked_fill(zero, 0)
        outputs.append(F.scaled_dot_product_attention(
            q[start:end].view(rows, num_q_heads, 1, head_dim), keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=mask[start:end, :num_blocks * block_size].view(rows, 1, 1, -1),
            scale=scale, enable_gqa=True))
    out = torch.cat(outputs) if len(outputs) > 1 else outputs[0]
    if len(bounds) > 1:
        out = out[order.argsort()]
    return out.view(num_seqs, num_q_heads, head_dim)
