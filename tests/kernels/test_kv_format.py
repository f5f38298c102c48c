"""KV cache storage formats (kernels/kv_format.py): names, checks, conversion, and the block
moves (copy-on-write, swap) on fp8 caches, whose CPU index ops run on the bytes."""
import pytest
import torch

from pagedserve.kernels.triton_copy_blocks import copy_blocks_ref
from pagedserve.kernels.kv_format import (KV_CACHE_DTYPES, check_storage, raw, resolve_kv_cache_dtype,
                               to_storage)
from pagedserve.kernels.swap_blocks import swap_blocks_ref
from pagedserve.pipeline.config import KV_CACHE_DTYPE_NAMES


def test_names_follow_vllm_and_the_config_flag():
    assert tuple(KV_CACHE_DTYPES) == KV_CACHE_DTYPE_NAMES
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("fp8", torch.float32) == torch.float8_e4m3fn
    assert resolve_kv_cache_dtype("fp8_e5m2", torch.float32) == torch.float8_e5m2
    assert resolve_kv_cache_dtype("bfloat16", torch.float32) == torch.bfloat16
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of auto, .*got 'int4'"):
        resolve_kv_cache_dtype("int4", torch.float32)


def test_a_cache_may_only_be_narrower_than_the_queries():
    check_storage("t", torch.float32, torch.bfloat16)
    check_storage("t", torch.bfloat16, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="t: a torch.float32 cache cannot serve torch.bfloat16"):
        check_storage("t", torch.bfloat16, torch.float32)
    with pytest.raises(ValueError, match="cannot serve"):
        check_storage("t", torch.float16, torch.bfloat16)


def test_fp8_storage_saturates_instead_of_overflowing():
    x = torch.tensor([1e6, -1e6, 0.5, float("inf")])
    e4m3 = to_storage(x, torch.float8_e4m3fn).float()
    assert e4m3.tolist() == [448.0, -448.0, 0.5, 448.0]
    assert to_storage(x, torch.float8_e5m2).float().tolist() == [57344.0, -57344.0, 0.5, 57344.0]
    assert to_storage(x, torch.float32) is x


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_copy_and_swap_move_fp8_blocks_bit_for_bit(rng, dtype):
    cache = to_storage(torch.randn(2, 2, 6, 4, 2, 8, generator=rng), dtype)
    before = raw(cache).clone()
    copy_blocks_ref(cache, torch.tensor([[1, 4], [3, 5]]))
    assert torch.equal(raw(cache)[:, :, 4], before[:, :, 1])
    assert torch.equal(raw(cache)[:, :, 5], before[:, :, 3])
    assert torch.equal(raw(cache)[:, :, :4], before[:, :, :4])
    host = torch.zeros(2, 2, 3, 4, 2, 8, dtype=dtype)
    swap_blocks_ref(cache, host, torch.tensor([[2, 0], [0, 2]]))
    assert torch.equal(raw(host)[:, :, 0], before[:, :, 2])
    assert torch.equal(raw(host)[:, :, 2], before[:, :, 0])
    assert not raw(host)[:, :, 1].any()
