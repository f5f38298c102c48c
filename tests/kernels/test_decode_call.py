"""A step's native decode attention prepared once (native_decode_attention.DecodeCall, kept in
the step's AttentionMetadata.prepared_calls) gives every layer the bits of the unprepared call."""
from __future__ import annotations

import pytest
import torch

from pagedserve import kernels
from pagedserve.kernels import native_decode_attention as nda

pytestmark = pytest.mark.skipif(nda.native.library(nda.FEATURE) is None,
                                reason="no native decode attention library here")


def caches(layers: int, dtype=torch.float32, num_blocks=40, block_size=16, hkv=2, d=64):
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(dtype),
             torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(dtype))
            for _ in range(layers)]


@pytest.mark.parametrize("cache_dtype,q_dtype", [(torch.float32, torch.float32),
                                                  (torch.bfloat16, torch.bfloat16),
                                                  (torch.float8_e4m3fn, torch.float32)])
@pytest.mark.parametrize("num_seqs", [1, 3, 9])
def test_every_layer_equals_the_unprepared_call(cache_dtype, q_dtype, num_seqs):
    layers = caches(4, cache_dtype)
    gen = torch.Generator().manual_seed(num_seqs)
    tables = torch.randperm(40, generator=gen)[:num_seqs * 4].reshape(num_seqs, 4).to(torch.int32)
    lens = torch.randint(1, 64, (num_seqs,), generator=gen, dtype=torch.int32)
    prepared: dict = {}
    for layer, (k, v) in enumerate(layers):
        window = 17 if layer % 2 else 0           # alternating windows: one entry each
        q = torch.randn(num_seqs, 6, 64, generator=gen).to(q_dtype)
        got = kernels.paged_decode_attention(q, k, v, tables, lens, 0.125, window=window,
                                             prepared=prepared)
        want = nda.paged_decode_attention_native(q, k, v, tables, lens, 0.125, window)
        assert got.dtype == q_dtype and torch.equal(got, want), layer
    assert len(prepared) == 2


def test_other_tables_or_shapes_are_prepared_again():
    (k, v), = caches(1)
    tables = torch.arange(8, dtype=torch.int32).reshape(2, 4)
    lens = torch.tensor([50, 9], dtype=torch.int32)
    prepared: dict = {}
    q = torch.randn(2, 6, 64)
    kernels.paged_decode_attention(q, k, v, tables, lens, 0.125, prepared=prepared)
    [(key, (held_tables, held_lens, call))] = prepared.items()
    assert held_tables is tables and held_lens is lens
    # another query shape under the same tables: prepared again, still the unprepared bits
    q4 = torch.randn(2, 4, 64)
    got = kernels.paged_decode_attention(q4, k, v, tables, lens, 0.125, prepared=prepared)
    assert torch.equal(got, nda.paged_decode_attention_native(q4, k, v, tables, lens, 0.125))
    assert prepared[key][2] is not call
    # other tables objects (even equal ones) get their own entry
    other = tables.clone()
    kernels.paged_decode_attention(q, k, v, other, lens, 0.125, prepared=prepared)
    assert len(prepared) == 2
    with pytest.raises(ValueError, match="do not match the call's preparation"):
        prepared[key][2](q, k[:, :8], v[:, :8], 0.125)
