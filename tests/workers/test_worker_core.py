"""WorkerCore driven by real StepPlans from a minimal greedy scheduler, against transformers."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve.pipeline.messages import Fork, NewSeq, ScheduledSeq, StepPlan, StepResult
from pagedserve.pipeline.sampling_params import SamplingParams
from pagedserve.workers.loader import load_config
from pagedserve.workers.model_runner import ModelRunner, SeqStep
from pagedserve.workers.sampler import Sampler
from pagedserve.workers.testing import hf_greedy, make_tiny_llama
from pagedserve.workers.core import WorkerCore, child_sampling

BLOCK_SIZE = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=1000)


def empty_plan(step_id, **fields) -> StepPlan:
    plan = dict(step_id=step_id, new_seqs=[], scheduled=[], swap_out=[], swap_in=[], copy=[],
                forks=[], finished_seq_ids=[])
    return StepPlan(**{**plan, **fields})


class GreedyScheduler:
    """Every live sequence runs every step; prompts go in chunks; blocks come from a shuffled
    free list so block tables are non-contiguous. Plans are diffs, as the real scheduler's."""

    def __init__(self, prompts, max_new_tokens, chunk, num_blocks, seed=0, columns=False):
        self.columns = columns  # one-token decodes without new blocks go in the decode columns
        self.free = np.random.default_rng(seed).permutation(num_blocks).tolist()
        self.max_new_tokens, self.chunk = max_new_tokens, chunk
        self.tokens = {i: list(p) for i, p in enumerate(prompts)}
        self.prompt_len = {i: len(p) for i, p in enumerate(prompts)}
        self.computed = dict.fromkeys(self.tokens, 0)
        self.blocks: dict[int, list[int]] = {i: [] for i in self.tokens}
        self.unsent = {i: [] for i in self.tokens}       # sampled ids the workers have not seen
        self.announced: set[int] = set()
        self.finished: list[int] = []
        self.step_id = 0

    def outputs(self, seq_id):
        return self.tokens[seq_id][self.prompt_len[seq_id]:]

    def live(self):
        return [i for i in self.tokens if len(self.outputs(i)) < self.max_new_tokens]

    def plan(self) -> StepPlan:
        new_seqs, scheduled, decode_ids, decode_tokens, decode_blocks = [], [], [], [], []
        for i in self.live():
            n = min(self.chunk, len(self.tokens[i]) - self.computed[i])
            new_blocks = []
            while (len(self.blocks[i]) + len(new_blocks)) * BLOCK_SIZE < self.computed[i] + n:
                new_blocks.append(self.free.pop())
            if i not in self.announced:
                new_seqs.append(NewSeq(i, self.tokens[i], [], GREEDY, [], 0))
                self.announced.add(i)
            if self.columns and n == 1 and len(self.unsent[i]) == 1:
                decode_blocks += [(len(decode_ids), block) for block in new_blocks]
                decode_ids.append(i)
                decode_tokens.append(self.unsent[i][0])
            else:
                scheduled.append(ScheduledSeq(i, n, new_blocks, self.unsent[i]))
            self.blocks[i] += new_blocks
            self.unsent[i] = []
            self.computed[i] += n
        self.step_id += 1
        self.rows = decode_ids + [s.seq_id for s in scheduled
                                  if self.computed[s.seq_id] == len(self.tokens[s.seq_id])]
        plan = empty_plan(self.step_id, new_seqs=new_seqs, scheduled=scheduled,
                          finished_seq_ids=self.finished, decode_seq_ids=decode_ids,
                          decode_token_ids=decode_tokens, decode_new_blocks=decode_blocks)
        self.finished = []
        return plan

    def update(self, result: StepResult) -> None:
        assert result.step_id == self.step_id
        # the rows: the decode columns, then the sampling sequences of `scheduled`, in order
        assert result.seq_ids == self.rows
        for seq_id, token in zip(result.seq_ids, result.token_ids):
            self.tokens[seq_id].append(token)
            self.unsent[seq_id].append(token)
            if len(self.outputs(seq_id)) == self.max_new_tokens:
                self.finished.append(seq_id)
                self.free += self.blocks.pop(seq_id)
                self.blocks[seq_id] = []


def run_greedy(execute, prompts, max_new_tokens, *, chunk=7, num_blocks=64, seed=0,
               columns=False):
    """Drive `execute(plan) -> StepResult` until every prompt has max_new_tokens outputs."""
    scheduler = GreedyScheduler(prompts, max_new_tokens, chunk, num_blocks, seed, columns)
    while scheduler.live():
        scheduler.update(execute(scheduler.plan()))
    execute(scheduler.plan())             # tells the workers the last sequences finished
    return [scheduler.outputs(i) for i in range(len(prompts))]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"), seed=5)


def make_core(model_dir, *, num_blocks=64, num_cpu_blocks=0, sampler=True, quantization="none",
              dtype=torch.float32):
    runner = ModelRunner(load_config(model_dir), model_dir, dtype, "cpu", BLOCK_SIZE,
                         num_blocks, quantization=quantization)
    return WorkerCore(runner, Sampler(seed=0) if sampler else None, num_cpu_blocks)


@pytest.mark.parametrize("columns", [False, True], ids=["scheduled", "decode-columns"])
def test_greedy_plans_match_transformers(tiny_dir, columns):
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 512, n).tolist() for n in (12, 30, 3, 47)]
    core = make_core(tiny_dir)
    assert run_greedy(core.execute, prompts, 12, columns=columns) == \
        hf_greedy(tiny_dir, prompts, 12)
    assert core.seqs == {}                # every finished sequence was dropped


def test_decode_columns_are_checked(tiny_dir):
    core = make_core(tiny_dir)
    plan = GreedyScheduler([[5, 6, 7, 8]], 4, 2, 64).plan()  # computes 2 of the 4 prompt tokens
    core.execute(plan)
    with pytest.raises(ValueError, match="2 decode_seq_ids but 1 decode_token_ids"):
        core.execute(empty_plan(2, decode_seq_ids=[0, 0], decode_token_ids=[9]))
    with pytest.raises(ValueError, match="seq 0: a decode column entry, but 2 of its known "
                                         "tokens are not computed yet"):
        core.execute(empty_plan(2, decode_seq_ids=[0], decode_token_ids=[9]))
    with pytest.raises(ValueError, match="decoding sequence 7 is unknown"):
        core.execute(empty_plan(2, decode_seq_ids=[7], decode_token_ids=[9]))
    with pytest.raises(ValueError, match="decode_new_blocks names column 1 of 1"):
        core.execute(empty_plan(2, decode_seq_ids=[0], decode_token_ids=[9],
                                decode_new_blocks=[(1, 3)]))


def test_rank_without_sampler_computes_and_returns_none(tiny_dir):
    core = make_core(tiny_dir, sampler=False)
    plan = GreedyScheduler([[5, 6, 7]], 1, 7, 64).plan()
    assert core.execute(plan) is None
    assert core.seqs[0].num_computed_tokens == 3


def test_fork_children_sample_the_parent_row_with_their_own_seeds(tiny_dir):
    params = SamplingParams(n=3, temperature=1.0, seed=1234)
    prompt = list(range(10, 30))
    plan = empty_plan(1, new_seqs=[NewSeq(7, prompt, [], params, [9, 4], 0)],
                      scheduled=[ScheduledSeq(7, 20, [], [])], forks=[Fork(7, [8, 9])])
    core = make_core(tiny_dir)
    result = core.execute(plan)
    assert result.seq_ids == [7, 8, 9]
    # The same logits row sampled alone with each sample's params gives the same tokens.
    logits = make_core(tiny_dir).runner.execute([SeqStep(prompt, 0, [9, 4], True)])
    for index, token in enumerate(result.token_ids):
        alone = Sampler()(logits, [child_sampling(params, index)], [prompt], [20])
        assert alone.token_ids == [token]
    assert len({child_sampling(params, i).seed for i in range(3)}) == 3
    child = core.seqs[9]
    assert (child.token_ids, child.block_ids, child.num_computed_tokens) == (prompt, [9, 4], 20)
    assert child.block_ids is not core.seqs[7].block_ids
    # Re-sent as NewSeq (swap-in, recompute, a new worker after a restart) a child comes with
    # its derived params from the scheduler, and keeps them.
    core.reset()
    core.execute(empty_plan(2, new_seqs=[NewSeq(9, prompt, [result.token_ids[2]],
                                                 child_sampling(params, 2), [9, 4], 20)]))
    assert core.seqs[9].sampling.seed == child_sampling(params, 2).seed


def test_copy_on_write_copies_every_layer(tiny_dir):
    core = make_core(tiny_dir)
    core.execute(empty_plan(1, new_seqs=[NewSeq(1, list(range(3, 40)), [], GREEDY, [5, 2, 11], 0)],
                            scheduled=[ScheduledSeq(1, 37, [], [])]))
    kv = core.runner.kv_cache
    assert not torch.equal(kv[:, :, 11], kv[:, :, 30])
    core.execute(empty_plan(2, copy=[(11, 30)]))
    assert torch.equal(kv[:, :, 11], kv[:, :, 30])


def test_swap_out_and_back_in_elsewhere_keeps_generation_exact(tiny_dir):
    prompt = list(range(100, 140))
    expected = hf_greedy(tiny_dir, [prompt], 4)[0]
    core = make_core(tiny_dir, num_blocks=16, num_cpu_blocks=8)
    r1 = core.execute(empty_plan(1, new_seqs=[NewSeq(1, prompt, [], GREEDY, [3, 7, 1], 0)],
                                 scheduled=[ScheduledSeq(1, 40, [], [])]))
    # Preempted by swapping: device blocks 3, 7, 1 -> host 6, 0, 2; then the device blocks are
    # reused by another sequence (overwritten), and the sequence comes back in 12, 4, 9.
    core.execute(empty_plan(2, swap_out=[(3, 6), (7, 0), (1, 2)]))
    core.execute(empty_plan(3, new_seqs=[NewSeq(2, list(range(48)), [], GREEDY, [3, 7, 1], 0)],
                            scheduled=[ScheduledSeq(2, 48, [], [])]))
    out = [r1.token_ids[0]]
    plan = empty_plan(4, swap_in=[(6, 12), (0, 4), (2, 9)], finished_seq_ids=[2],
                      new_seqs=[NewSeq(1, prompt, out[:], GREEDY, [12, 4, 9], 40)],
                      scheduled=[ScheduledSeq(1, 1, [], [])])
    for step in range(5, 8):
        out.append(core.execute(plan).token_ids[0])
        plan = empty_plan(step, scheduled=[ScheduledSeq(1, 1, [], [out[-1]])])
    assert out == expected


def test_unknown_sequence_is_a_clear_error(tiny_dir):
    core = make_core(tiny_dir)
    with pytest.raises(ValueError, match="scheduled sequence 42 is unknown"):
        core.execute(empty_plan(1, scheduled=[ScheduledSeq(42, 1, [], [])]))


def run_ahead(execute, prompts, steps, first_id=0):
    """A prefill, then `steps` decode plans made ahead (-1 in every decode column), as the
    scheduler sends them under overlapped scheduling: each lane decodes what rank 0 sampled."""
    ids = [first_id + i for i in range(len(prompts))]
    tables, start = [], 10
    for p in prompts:
        num_blocks = -(-(len(p) + steps) // BLOCK_SIZE)
        tables.append(list(range(start, start + num_blocks)))
        start += num_blocks
    first = execute(empty_plan(1, new_seqs=[NewSeq(sid, p, [], GREEDY, table, 0)
                                            for sid, p, table in zip(ids, prompts, tables)],
                               scheduled=[ScheduledSeq(sid, len(p), [], [])
                                          for sid, p in zip(ids, prompts)]))
    outputs = [[t] for t in first.token_ids]
    for step in range(2, 2 + steps):
        result = execute(empty_plan(step, decode_seq_ids=ids, decode_token_ids=[-1] * len(ids),
                                    ahead=True))
        for out, token in zip(outputs, result.token_ids):
            out.append(token)
    execute(empty_plan(2 + steps, finished_seq_ids=ids))
    return outputs


def test_a_plan_made_ahead_decodes_the_tokens_this_rank_sampled(tiny_dir):
    """Overlapped scheduling: a plan sent before the last result was back carries -1s in its
    decode columns; the worker decodes what it sampled, as if the scheduler had sent it."""
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42]]
    core = make_core(tiny_dir)
    assert run_ahead(core.execute, prompts, 3) == hf_greedy(tiny_dir, prompts, 4)
    with pytest.raises(ValueError, match="seq 2 sampled nothing yet"):
        core.execute(empty_plan(5, new_seqs=[NewSeq(2, [3, 4], [], GREEDY, [20], 1)],
                                decode_seq_ids=[2], decode_token_ids=[-1], ahead=True))
    other_rank = make_core(tiny_dir, sampler=False)
    with pytest.raises(ValueError, match="this rank does not sample"):
        other_rank.execute(empty_plan(1, decode_seq_ids=[0], decode_token_ids=[-1], ahead=True))


def test_a_cpu_worker_never_imports_triton(tiny_dir):
    """Triton holds ~100 MB of a process's RSS: a CPU worker's steps (chunked prefill, decode,
    copy-on-write) run the native kernels and the torch references, and never import it."""
    import os
    import subprocess
    import sys
    code = (
        "import sys\nsys.path.insert(0, 'tests/workers')\n"
        "import torch\nfrom test_worker_core import make_core, run_greedy\n"
        "from pagedserve import kernels\n"
        f"core = make_core({str(tiny_dir)!r})\n"
        "out = run_greedy(core.execute, [[5, 9, 3] * 9, [7, 8]], 6, chunk=7)\n"
        "assert [len(o) for o in out] == [6, 6], out\n"
        "kv = torch.randn(2, 2, 4, 16, 2, 8)\n"
        "kernels.copy_blocks(kv, torch.tensor([[0, 3]]))\n"
        "assert torch.equal(kv[:, :, 3], kv[:, :, 0])\n"
        "assert 'triton' not in sys.modules, [m for m in sys.modules if 'triton' in m][:5]\n"
        "import pagedserve.kernels.triton_copy_blocks\n"
        "assert 'triton' in sys.modules    # the check above can fail\n")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PAGEDSERVE_KERNELS")}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                            timeout=300, cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]


def test_a_long_steps_mlp_runs_in_slices_of_rows_with_the_same_result(tiny_dir, monkeypatch):
    from pagedserve.workers.models import decoder
    mlp = make_core(tiny_dir).runner.model.layers[0].mlp
    x = torch.randn(300, load_config(tiny_dir).hidden_size,
                    generator=torch.Generator().manual_seed(3))
    monkeypatch.setattr(decoder, "MLP_ROWS", 10**9)
    whole = mlp(x)
    calls = []
    inner = mlp.gate_up_proj.forward
    monkeypatch.setattr(mlp.gate_up_proj, "forward", lambda part: calls.append(len(part))
                        or inner(part))
    monkeypatch.setattr(decoder, "MLP_ROWS", 64)
    sliced = mlp(x)
    assert calls == [64, 64, 64, 64, 44]
    torch.testing.assert_close(sliced, whole, rtol=1e-5, atol=1e-6)
