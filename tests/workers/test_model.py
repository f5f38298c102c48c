"""Our Llama over a paged, flattened batch against transformers' own forward (fp32)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pagedserve.workers.loader import load_config
from pagedserve.workers.model_runner import ModelRunner, SeqStep
from pagedserve.workers.models.layers import partition_heads
from pagedserve.workers.models.rotary import rope_inv_freq
from pagedserve.workers.testing import hf_greedy, make_tiny_llama

BLOCK_SIZE, NUM_BLOCKS = 16, 64


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"), seed=3, tie=False)


@pytest.fixture(scope="module")
def hf_model(tiny_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


def make_runner(model_dir, num_blocks=NUM_BLOCKS):
    return ModelRunner(load_config(model_dir), model_dir, torch.float32, "cpu", BLOCK_SIZE,
                       num_blocks)


def all_row_logits(runner, items):
    """Logits of every computed row, in the runner's flattened order, plus that order."""
    step = runner.prepare(items)
    with torch.inference_mode():
        hidden = runner.model(step.input_ids, step.positions, runner.kv_cache, step.meta)
        return runner.model.compute_logits(hidden), step


@torch.no_grad()
def hf_logits(hf_model, tokens):
    return hf_model(torch.tensor([tokens])).logits[0]


def test_mixed_decode_and_prefill_chunks_match_transformers(tiny_dir, hf_model):
    runner = make_runner(tiny_dir)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 512, n).tolist() for n in (40, 21, 9, 33)]
    blocks = rng.permutation(NUM_BLOCKS).tolist()    # shuffled, non-contiguous tables
    tables = [blocks[0:3], blocks[10:12], blocks[20:21], blocks[30:33]]
    # Step 1: A computes 25 tokens, B 20, C one token (a 1-token prefill takes the decode path).
    all_row_logits(runner, [SeqStep(prompts[0][:25], 0, tables[0], False),
                            SeqStep(prompts[1][:20], 0, tables[1], False),
                            SeqStep(prompts[2][:1], 0, tables[2], False)])
    # Step 2, every kind at once: A's last chunk over its cached prefix, B a decode token, C a
    # chunk, D a fresh prompt.
    items = [SeqStep(prompts[0][25:], 25, tables[0], True), SeqStep(prompts[1][20:], 20, tables[1], True),
             SeqStep(prompts[2][1:], 1, tables[2], True), SeqStep(prompts[3], 0, tables[3], True)]
    logits, step = all_row_logits(runner, items)
    assert step.meta.num_decode_tokens == 1
    positions = step.positions.tolist()
    order = [1, 0, 2, 3]                                 # decode rows first
    row = 0
    for i in order:
        ref = hf_logits(hf_model, prompts[i])
        n = len(items[i].token_ids)
        assert positions[row:row + n] == list(range(items[i].start_pos, items[i].start_pos + n))
        torch.testing.assert_close(logits[row:row + n], ref[items[i].start_pos:], rtol=1e-4, atol=1e-4)
        row += n
    # execute() returns the sampled rows in item order.
    runner2 = make_runner(tiny_dir)
    sampled = runner2.execute([SeqStep(prompts[3], 0, tables[3], True),
                               SeqStep(prompts[2][:1], 0, tables[2], False),
                               SeqStep(prompts[0][:25], 0, tables[0], True)])
    assert sampled.dtype == torch.float32 and sampled.shape == (2, 512)
    torch.testing.assert_close(sampled[0], hf_logits(hf_model, prompts[3])[-1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(sampled[1], hf_logits(hf_model, prompts[0][:25])[-1], rtol=1e-4, atol=1e-4)


def greedy_by_chunks(runner, prompts, max_new_tokens, chunk, rng):
    """A minimal scheduler: every step, all live sequences together; prompts in chunks."""
    free = rng.permutation(runner.num_blocks).tolist()
    tokens = [list(p) for p in prompts]
    computed = [0] * len(prompts)
    tables: list[list[int]] = [[] for _ in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    while any(len(o) < max_new_tokens for o in outputs):
        live = [i for i, o in enumerate(outputs) if len(o) < max_new_tokens]
        items = []
        for i in live:
            n = min(chunk, len(tokens[i]) - computed[i])
            while len(tables[i]) * BLOCK_SIZE < computed[i] + n:
                tables[i].append(free.pop())
            items.append(SeqStep(tokens[i][computed[i]:computed[i] + n], computed[i], tables[i],
                                 computed[i] + n == len(tokens[i])))
            computed[i] += n
        next_ids = runner.execute(items).argmax(-1).tolist()
        for i in (i for i, item in zip(live, items) if item.sample):
            token = next_ids.pop(0)
            tokens[i].append(token)
            outputs[i].append(token)
    return outputs


def test_greedy_in_chunks_of_7_matches_transformers(tiny_dir):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 512, n).tolist() for n in (5, 23, 40, 61, 1)]
    ours = greedy_by_chunks(make_runner(tiny_dir), prompts, 20, 7, rng)
    assert ours == hf_greedy(tiny_dir, prompts, 20)


def test_block_table_too_short_is_a_clear_error(tiny_dir):
    runner = make_runner(tiny_dir)
    with pytest.raises(ValueError, match="block table of 1 blocks cannot hold position 16"):
        runner.prepare([SeqStep([1], 3, [5], True), SeqStep(list(range(17)), 0, [2], True)])


def test_missing_weight_is_reported(tiny_dir):
    from pagedserve.workers.loader import iter_weights
    from pagedserve.workers.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM(load_config(tiny_dir))
    with pytest.raises(ValueError, match="missing 1 tensors.*layers.1.mlp.down_proj"):
        model.load_weights((n, t) for n, t in iter_weights(tiny_dir)
                           if n != "model.layers.1.mlp.down_proj.weight")


@pytest.mark.parametrize("heads, kv_heads, tp, expected", [
    (9, 3, 2, [(range(0, 6), (0, 1)), (range(6, 9), (2,))]),                 # SmolLM2 at tp 2
    (8, 2, 4, [(range(0, 2), (0,)), (range(2, 4), (0,)), (range(4, 6), (1,)), (range(6, 8), (1,))]),
    (16, 4, 5, [(range(0, 4), (0,)), (range(4, 7), (1,)), (range(7, 10), (1, 2, 2)),
                (range(10, 13), (2, 2, 3)), (range(13, 16), (3,))]),
    (4, 4, 1, [(range(0, 4), (0, 1, 2, 3))]),
])
def test_partition_heads(heads, kv_heads, tp, expected):
    parts = [partition_heads(heads, kv_heads, tp, r) for r in range(tp)]
    assert [(p.q_heads, p.kv_heads) for p in parts] == expected
    group = heads // kv_heads
    for p in parts:     # the kernels' GQA rule reproduces the true kv head of every q head
        local_group = len(p.q_heads) // len(p.kv_heads)
        assert [p.kv_heads[i // local_group] for i in range(len(p.q_heads))] == \
               [h // group for h in p.q_heads]


@pytest.mark.parametrize("scaling", [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
])
def test_rope_frequencies_match_transformers(scaling):
    params = {"rope_type": "default", "rope_theta": 500000.0, **(scaling or {})}
    cfg = LlamaConfig(hidden_size=2048, num_attention_heads=32, rope_parameters=params,
                      max_position_embeddings=131072)
    expected, _ = ROPE_INIT_FUNCTIONS.get(params["rope_type"], None)(cfg, "cpu") \
        if params["rope_type"] != "default" else (None, None)
    ours = rope_inv_freq(64, 500000.0, scaling).float()
    if expected is None:
        expected = 1.0 / 500000.0 ** (torch.arange(0, 64, 2).float() / 64)
    torch.testing.assert_close(ours, expected.float(), rtol=1e-6, atol=0)


def test_unsupported_rope_scaling_is_refused():
    with pytest.raises(ValueError, match="rope_scaling type 'yarn' is not supported"):
        rope_inv_freq(64, 10000.0, {"rope_type": "yarn", "factor": 4.0})


def smollm2_shapes():
    from pagedserve.workers.loader import ModelConfig

    return ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576,
                       intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                       num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5,
                       rope_scaling=None, max_position_embeddings=8192, tie_word_embeddings=True,
                       bos_token_id=1, eos_token_ids=(2,))


def test_kv_cache_sizing_and_per_rank_layout():
    from pagedserve.workers.kv_cache import (allocate_kv_cache, allocate_swap_pool, block_bytes,
                                  device_budget_bytes, num_blocks_for_bytes)

    config = smollm2_shapes()
    assert block_bytes(config, 16, torch.bfloat16) == 30 * 2 * 16 * 3 * 64 * 2 == 368_640
    assert block_bytes(config, 16, torch.bfloat16, tp_size=2) == 245_760    # rank 0: 2 kv heads
    assert num_blocks_for_bytes(config, 16, torch.bfloat16, 368_640 * 10 + 5) == 10
    assert device_budget_bytes("cpu", kv_cache_memory=1 << 20) == 1 << 20
    with pytest.raises(ValueError, match="--kv-cache-memory"):
        device_budget_bytes("cpu")
    ranks = [allocate_kv_cache(config, 3, 16, torch.bfloat16, "cpu", 2, r) for r in range(2)]
    assert [tuple(kv.shape) for kv in ranks] == [(30, 2, 3, 16, 2, 64), (30, 2, 3, 16, 1, 64)]
    assert tuple(allocate_swap_pool(ranks[1], 5).shape) == (30, 2, 5, 16, 1, 64)
    with pytest.raises(ValueError, match="at least one block"):
        allocate_kv_cache(config, 0, 16, torch.bfloat16, "cpu")


def prefix_then_decode_steps(seed: int, long_len: int, split: int, other_len: int):
    """Two steps over three sequences: step 1 prefills the first `split` tokens of a long prompt
    (not sampled), a whole prompt of `other_len` and a 1-token prompt; step 2 computes the long
    prompt's rest after its cached prefix, beside one decode token for each of the others."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 512, n).tolist() for n in (long_len, other_len, 1)]
    tables = [[0, 1, 2], [5, 6], [9]]
    return [[SeqStep(prompts[0][:split], 0, tables[0], False),
             SeqStep(prompts[1], 0, tables[1], True), SeqStep(prompts[2], 0, tables[2], True)],
            [SeqStep(prompts[0][split:], split, tables[0], True),
             SeqStep([7], other_len, tables[1], True), SeqStep([9], 1, tables[2], True)]]


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_narrow_kv_cache_computes_what_its_values_hold(tiny_dir, monkeypatch, cache_dtype):
    """--kv-cache-dtype: an fp32 model over a bf16 or fp8 cache equals an fp32 cache holding the
    same rounded K/V. The first step reads fresh K/V back through the prefill kernel; the second
    reads the cache through both the decode and the prefill kernels. (How much the rounding
    itself costs is a property of the model: on SmolLM2, see README.)"""
    from pagedserve import kernels
    from pagedserve.kernels import native_rope_store
    from pagedserve.kernels.kv_format import to_storage
    steps = prefix_then_decode_steps(seed=5, long_len=30, split=20, other_len=17)
    narrow = ModelRunner(load_config(tiny_dir), tiny_dir, torch.float32, "cpu", BLOCK_SIZE,
                         NUM_BLOCKS, kv_cache_dtype=cache_dtype)
    assert narrow.kv_cache.dtype == cache_dtype
    narrow_logits = [all_row_logits(narrow, items)[0].clone() for items in steps]  # own buffers

    store = kernels.store_kv
    def store_rounded(key, value, k_cache, v_cache, slots):
        store(to_storage(key, cache_dtype).float(), to_storage(value, cache_dtype).float(),
              k_cache, v_cache, slots)
    monkeypatch.setattr(kernels, "store_kv", store_rounded)
    # the fused RoPE + store (fp32 CPU) writes the cache itself: the wide model takes the torch
    # path, whose store is patched (the narrow one above used the fused kernel for bf16)
    monkeypatch.setattr(native_rope_store, "supports", lambda *args: False)
    wide = make_runner(tiny_dir)
    for items, got in zip(steps, narrow_logits):
        torch.testing.assert_close(got, all_row_logits(wide, items)[0], rtol=1e-4, atol=1e-4)


def test_a_cache_wider_than_the_model_is_refused_at_start(tiny_dir):
    with pytest.raises(ValueError, match="--kv-cache-dtype: a torch.float32 cache cannot serve "
                                         "torch.bfloat16 queries"):
        ModelRunner(load_config(tiny_dir), tiny_dir, torch.bfloat16, "cpu", BLOCK_SIZE, 4,
                    kv_cache_dtype=torch.float32)


def test_prefill_rows_through_the_native_decode_kernel_match_the_prefill_path(tiny_dir,
                                                                             monkeypatch):
    """On CPU the runner gives every prefill row its table and causal context, and attend runs
    them through the native decode kernel; the per-sequence prefill path must give the same
    logits: fresh prompts, a chunk after a cached prefix, and decode rows in the same step."""
    from pagedserve import kernels
    if not kernels.native_decode_rows(torch.zeros(1, 4, 16), torch.zeros(1, 16, 2, 16)):
        pytest.skip("the native decode kernel is not the CPU path here")
    steps = prefix_then_decode_steps(seed=11, long_len=40, split=17, other_len=23)
    native_rows = make_runner(tiny_dir)
    assert native_rows.prepare(steps[0]).meta.prefill_row_tables is not None
    got = [all_row_logits(native_rows, items)[0].clone() for items in steps]
    monkeypatch.setattr(kernels, "native_decode_rows", lambda *args: False)
    per_sequence = make_runner(tiny_dir)
    for items, logits in zip(steps, got):
        torch.testing.assert_close(logits, all_row_logits(per_sequence, items)[0],
                                   rtol=1e-4, atol=1e-4)
