"""Sliding-window attention through workers/models/attention.attend on CPU: a prompt prefilled in
chunks of 7 across the window's edge, then decoded, with every block that slid wholly out of the
window full of NaN (the scheduler frees those and they may be reused), on each CPU decode path:
the native kernel (prefill rows as decode queries, prefill_row_tables), the torch reference
(paged_prefill_attention_ref) and the bucketed path."""
import pytest
import torch
from native_variants import NEEDS_COMPILER
from paged_inputs import chunked_prefill, naive_attention, poison_before_windows, rel_error

from pagedserve import envs, kernels
from pagedserve.workers.models.attention import AttentionMetadata, attend


def _metadata(table, start, context_len, decode):
    """One sequence's step: a decode row (decode=True) or a prefill chunk [start, context_len)."""
    empty_tables = table[:0]
    empty = torch.zeros(0, dtype=torch.int32)
    lens = torch.tensor([context_len], dtype=torch.int32)
    if decode:
        return AttentionMetadata(torch.zeros(1, dtype=torch.int64), 1, table, lens,
                                 empty_tables, torch.zeros(1, dtype=torch.int32), empty)
    rows = context_len - start
    return AttentionMetadata(
        torch.zeros(rows, dtype=torch.int64), 0, empty_tables, empty, table,
        torch.tensor([0, rows], dtype=torch.int32), lens,
        prefill_row_tables=table.expand(rows, -1).contiguous(),
        prefill_row_context_lens=torch.arange(start + 1, context_len + 1, dtype=torch.int32))


@pytest.mark.parametrize("decode_cpu", [pytest.param("native", marks=NEEDS_COMPILER), "ref",
                                        "bucketed"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_chunked_prefill_then_decode_across_the_window_edge(rng, decode_cpu, block_size):
    window, prompt, decodes = 16, 42, 3     # 6 chunks of 7, 3 decode steps
    k_cache, v_cache, table, scale, steps = chunked_prefill(
        rng, prompt + decodes, 7, block_size, window, head_dim=64, num_q_heads=14,
        num_kv_heads=2)
    with envs.override(decode_cpu=decode_cpu):
        assert kernels.native_decode_rows(k_cache, k_cache) == (decode_cpu == "native")
        for step in steps:
            if step.start >= prompt:
                break
            meta = _metadata(table, step.start, step.context_len, decode=False)
            out = attend(step.q, k_cache, v_cache, meta, scale, window=window)
            assert rel_error(out, step.expected) < 1e-5, step.start
        for pos in range(prompt, prompt + decodes):
            poison_before_windows(k_cache, v_cache, table, [pos], window)
            q = torch.randn(1, 14, 64, generator=rng)
            out = attend(q, k_cache, v_cache, _metadata(table, pos, pos + 1, decode=True), scale,
                         window=window)
            expected = naive_attention(q, k_cache, v_cache, table[0], pos + 1, 1, scale, window)
            assert rel_error(out, expected) < 1e-5, pos
