"""CPU decode replay (workers/cpu_decode_replay.py): a replayed step (decodes, drafts, short
prefill chunks) computes the eager step's logits and KV cache bit for bit, on every linear
kernel, cache dtype and window it runs; what it cannot run stays eager, with the reason; a
kernel's failure names its op."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve import envs
from pagedserve.kernels import native_replay as replay
from pagedserve.workers.cpu_decode_replay import MAX_ROWS, unsupported_reason
from pagedserve.workers.loader import TEST_MODEL, load_config, resolve_model
from pagedserve.workers.model_runner import ModelRunner, SeqStep
from pagedserve.workers.testing import make_tiny_model

BLOCK = 16
SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)
TINY = {"llama": SMALL,
        "mistral": {**SMALL, "head_dim": 16, "sliding_window": 13},
        "qwen2": {**SMALL, "use_sliding_window": True, "sliding_window": 9,
                  "max_window_layers": 1},
        "qwen3": {**SMALL, "head_dim": 16},
        "gemma3": {**SMALL, "head_dim": 16, "sliding_window": 11,
                   "layer_types": ["sliding_attention", "full_attention"]}}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("replay-models")
    return {arch: make_tiny_model(root / arch, arch, seed=4, **config)
            for arch, config in TINY.items()}


def make_runner(model_dir, quantization="auto", kv_dtype=None, num_blocks=160):
    return ModelRunner(load_config(model_dir), model_dir, torch.float32, "cpu", BLOCK,
                       num_blocks, kv_cache_dtype=kv_dtype, quantization=quantization)


def both_ways(runner: ModelRunner, steps: list[list[SeqStep]]
              ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The same steps from the same cache, replayed and eager: each way's logits of every step
    (concatenated) and its final cache."""
    start = runner.kv_cache.clone()
    recorded = runner.cpu_replay
    assert recorded is not None, "the runner does not replay: the comparison would be vacuous"
    outcome = {}
    for way in ("replay", "eager"):
        runner.kv_cache.copy_(start)
        runner.cpu_replay = recorded if way == "replay" else None
        logits = [runner.execute(step).clone() for step in steps]
        outcome[way] = (torch.cat(logits), runner.kv_cache.clone())
    runner.cpu_replay = recorded
    rows = {sum(len(item.token_ids) for item in step) for step in steps}
    assert rows & {key[0] for key in recorded._programs}, "never replayed"
    return outcome


def block_tables(lengths: list[int]) -> list[list[int]]:
    """Disjoint tables for sequences of these lengths, each one's blocks in reverse order."""
    needs = [-(-n // BLOCK) for n in lengths]
    ends = np.cumsum(needs).tolist()
    return [list(range(end - need, end))[::-1] for need, end in zip(needs, ends)]


def decode_both_ways(runner: ModelRunner, prompt_lens: list[int], steps: int, vocab: int,
                     seed: int = 0) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Prefill random prompts, then `steps` decode steps of every sequence, both ways."""
    rng = np.random.default_rng(seed)
    tables = block_tables([n + steps for n in prompt_lens])
    assert sum(map(len, tables)) <= runner.num_blocks
    runner.execute([SeqStep(rng.integers(3, vocab, n).tolist(), 0, table, True)
                    for n, table in zip(prompt_lens, tables)])
    tokens = rng.integers(3, vocab, (steps, len(prompt_lens)))
    return both_ways(runner, [[SeqStep([int(tokens[s, i])], n + s, tables[i], True)
                               for i, n in enumerate(prompt_lens)] for s in range(steps)])


def recorded_kinds(runner: ModelRunner) -> set[int]:
    return {int(k) for program, _ in runner.cpu_replay._programs.values()
            for k in program.ops[:, 0]}


def assert_identical(outcome) -> None:
    (replayed, cache_r), (eager, cache_e) = outcome["replay"], outcome["eager"]
    assert torch.equal(replayed, eager), (replayed - eager).abs().max()
    assert torch.equal(cache_r, cache_e)


@pytest.mark.parametrize("arch,quantization,kv_dtype", [
    ("llama", "int8", None), ("llama", "int8", torch.bfloat16), ("llama", "none", None),
    ("mistral", "int8", None), ("qwen2", "int8", None), ("qwen2", "none", torch.bfloat16)])
def test_replayed_steps_equal_eager_steps_bit_for_bit(tiny_dirs, arch, quantization, kv_dtype):
    # fp32 weights on the native panel kernel whatever this CPU's default (oneDNN on AVX-512)
    with envs.override(fp32_linear="native"):
        runner = make_runner(tiny_dirs[arch], quantization, kv_dtype)
        # one context past 512 tokens: its attention is cut into partitions
        assert_identical(decode_both_ways(runner, [600, 5, 37], 6, 512))
        assert_identical(decode_both_ways(runner, [21], 4, 512, seed=1))
    kinds = recorded_kinds(runner)
    assert (replay.LINEAR_Q8 if quantization == "int8" else replay.LINEAR_F32) in kinds
    assert (replay.ADD_ROWS in kinds) == (arch == "qwen2")   # the q/k/v bias


def test_the_default_model_replays_its_gguf_blocks_bit_for_bit():
    runner = make_runner(resolve_model(TEST_MODEL), num_blocks=96)
    assert runner.quantization == "gguf"
    assert_identical(decode_both_ways(runner, [530, 9, 70, 3, 12], 3, 40000))
    assert_identical(decode_both_ways(runner, [15], 3, 40000, seed=2))
    assert recorded_kinds(runner) & {replay.GGUF_LINEAR, replay.GGUF_PACKED}


def test_steps_of_several_tokens_a_sequence_replay_bit_for_bit(tiny_dirs):
    """Drafts (a sequence's next token and k guesses, each row's logits wanted), short prefill
    chunks (the first of a prompt, a later one, one that does not sample) and decodes, mixed."""
    runner = make_runner(tiny_dirs["qwen2"], "int8")
    rng = np.random.default_rng(5)
    tables = block_tables([700, 60, 60, 40])
    runner.execute([SeqStep(rng.integers(3, 512, 600).tolist(), 0, tables[0], True)])
    runner.execute([SeqStep(rng.integers(3, 512, 30).tolist(), 0, tables[1], True)])

    def tokens(n):
        return rng.integers(3, 512, n).tolist()
    steps = [
        [SeqStep(tokens(5), 600, tables[0], True, num_drafts=4),       # drafts past 512
         SeqStep(tokens(1), 30, tables[1], True),
         SeqStep(tokens(9), 0, tables[2], False)],                     # a chunk, no sample
        [SeqStep(tokens(1), 605, tables[0], True),
         SeqStep(tokens(3), 31, tables[1], True, num_drafts=2),
         SeqStep(tokens(12), 9, tables[2], True),                      # the prompt's last chunk
         SeqStep(tokens(7), 0, tables[3], True)],
        [SeqStep(tokens(4), 606, tables[0], True, num_drafts=3)],
        # every row samples, and the drafts' item comes before the decode's (rows are not in
        # item order): the engine's steady speculation
        [SeqStep(tokens(3), 610, tables[0], True, num_drafts=2),
         SeqStep(tokens(1), 34, tables[1], True)]]
    outcome = both_ways(runner, steps)
    assert outcome["replay"][0].shape[0] == 5 + 1 + 0 + 1 + 3 + 1 + 1 + 4 + 3 + 1
    assert_identical(outcome)


def test_steps_it_does_not_replay_run_eagerly(tiny_dirs):
    runner = make_runner(tiny_dirs["llama"], "int8")
    calls = []
    # counts the replayed steps (their hidden states are zeros)
    runner.cpu_replay.run = lambda *args: calls.append(args) or torch.zeros(1, 64)
    table = list(range(8))
    runner.execute([SeqStep(list(range(3, 3 + MAX_ROWS + 1)), 0, table, True)])  # a long chunk
    many = [SeqStep([3], 0, [16 + i], True) for i in range(MAX_ROWS + 1)]        # many decodes
    assert runner.execute(many).shape == (MAX_ROWS + 1, 512)
    for setting in ({"native_elementwise": False}, {"cpu_decode_replay": False},
                    {"decode_cpu": "ref"}):   # changed after the runner was built
        with envs.override(**setting):
            runner.execute([SeqStep([9], MAX_ROWS + 1, table, True)])
    assert calls == []
    runner.execute([SeqStep([9], MAX_ROWS + 2, table, True)])
    assert len(calls) == 1


@pytest.mark.parametrize("arch,reason", [("gemma3", "is not the plain decoder"),
                                         ("qwen3", "without q/k norms")])
def test_models_it_cannot_replay_say_why_and_run_eagerly(tiny_dirs, arch, reason):
    runner = make_runner(tiny_dirs[arch], "int8")
    assert runner.cpu_replay is None
    assert reason in unsupported_reason(runner.model, runner.kv_cache)


def test_it_is_off_when_asked_and_for_linears_without_a_native_kernel(tiny_dirs):
    with envs.override(cpu_decode_replay=False):
        assert make_runner(tiny_dirs["llama"], "int8").cpu_replay is None
    with envs.override(fp32_linear="onednn"):
        runner = make_runner(tiny_dirs["llama"], "none")
    assert runner.cpu_replay is None
    assert "no native fp32 kernel" in unsupported_reason(runner.model, runner.kv_cache)


def test_a_failing_kernel_names_its_op(tiny_dirs):
    runner = make_runner(tiny_dirs["llama"], "int8", num_blocks=8)
    runner.execute([SeqStep([5, 6, 7], 0, [0], True)])
    with pytest.raises(RuntimeError, match=r"op 2 \(layer 0 rope_store\) returned status -2"):
        runner.execute([SeqStep([8], 3, [99], True)])   # block 99: a slot past the cache


def test_program_checks_its_ops_and_passes_floats_as_fp32_bits():
    program = replay.Program()
    with pytest.raises(ValueError, match="op kind 9 takes 5 arguments, got 2"):
        program.add(replay.ADD_ROWS, "bias", 1, 2)
    with pytest.raises(ValueError, match="unknown op kind 42"):
        program.add(42, "nothing")
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    bias = torch.tensor([0.5, -1.0, 2.0, 0.25])
    expected = x[:2] + bias
    program.add(replay.ADD_ROWS, "bias", x.data_ptr(), 2, 4, 4, bias.data_ptr())
    seconds = np.zeros(replay.OP_KINDS)
    program.run(seconds)
    assert torch.equal(x[:2], expected) and torch.equal(x[2], torch.arange(8, 12.0))
    assert seconds[replay.ADD_ROWS] > 0 and seconds.sum() == seconds[replay.ADD_ROWS]
    program.add(replay.ADD_ROWS, "bad bias", x.data_ptr(), 1, 4, 3, bias.data_ptr())  # ld < cols
    with pytest.raises(RuntimeError, match=r"op 1 \(bad bias\) returned status -1"):
        program.run()
    assert replay._word(replay.F32(1.5)) == 0x3FC00000
