"""Workers read their block tables from the scheduler's shared-memory rows.

The real Scheduler and KVCacheManager (owning SharedBlockTables) drive a WorkerCore in this
process, which attaches the segment read-only as a worker on the same host does. Its outputs
equal the same run on the plans' block ids, with prefix sharing, n > 1 forks, swap and recompute
preemption, and aborts that arrive while the plan holding the aborted sequence is in flight.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve.kvmanager import SharedBlockTables
from pagedserve.pipeline.sampling_params import SamplingParams
from pagedserve.pipeline.scheduler import Scheduler, SchedulerConfig
from pagedserve.pipeline.scheduler.sequence import Request
from pagedserve.workers.loader import load_config
from pagedserve.workers.model_runner import ModelRunner
from pagedserve.workers.sampler import Sampler
from pagedserve.workers.testing import make_tiny_llama
from pagedserve.workers.core import WorkerCore

BLOCK_SIZE, MAX_MODEL_LEN, NUM_CPU_BLOCKS = 16, 256, 24


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"), seed=11)


def _requests() -> list[Request]:
    rng = np.random.default_rng(4)
    shared_prefix = rng.integers(3, 500, 40).tolist()
    reqs = []
    for i in range(7):
        prompt = (shared_prefix if i % 2 else []) + rng.integers(3, 500, 9 + 13 * i).tolist()
        sampling = SamplingParams(temperature=0.0, max_tokens=20 + 3 * i, ignore_eos=True)
        reqs.append(Request(f"r{i}", prompt, sampling))
    reqs.append(Request("n3", shared_prefix + [7, 8, 9], SamplingParams(
        temperature=0.8, seed=3, n=3, max_tokens=18, ignore_eos=True)))
    return reqs


def _run(model_dir, *, shared: bool, preemption_mode: str, num_gpu_blocks: int,
         aborts: dict[int, str] | None = None):
    """Generate every request; `aborts` maps a step to a request aborted after that step's plan
    went out. Returns ({(request, index): tokens}, the WorkerCore, how many steps read rows)."""
    cfg = SchedulerConfig(MAX_MODEL_LEN, BLOCK_SIZE, max_num_seqs=8, max_num_batched_tokens=64,
                          preemption_mode=preemption_mode, watermark=0.0)
    tables = SharedBlockTables(cfg.max_num_seqs + NUM_CPU_BLOCKS,
                               -(-MAX_MODEL_LEN // BLOCK_SIZE)) if shared else None
    sched = Scheduler.from_config(cfg, num_gpu_blocks, NUM_CPU_BLOCKS, block_tables=tables)
    runner = ModelRunner(load_config(model_dir), model_dir, torch.float32, "cpu", BLOCK_SIZE,
                         num_gpu_blocks)
    reads = []
    original = runner._shared_block_tables
    runner._shared_block_tables = lambda *a: reads.append(1) or original(*a)
    core = WorkerCore(runner, Sampler(seed=0), NUM_CPU_BLOCKS)
    for req in _requests():
        sched.add(req)
    tokens: dict[tuple[str, int], list[int]] = {}
    try:
        for step in range(2000):
            if not sched.has_unfinished():
                break
            plan = sched.schedule(float(step))
            if aborts and step in aborts:
                sched.abort(aborts[step])          # arrives while the plan is in flight
            for out in sched.update(plan, core.execute(plan), float(step)):
                tokens.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
        else:
            raise AssertionError("not finished")
        core.execute(sched.schedule(9999.0))       # the last finished ids reach the worker
        if shared:
            sched.kv.hold_rows(False)
            assert (tables.array == -1).all()      # every row came back
        return tokens, core, len(reads), sched.num_preemptions
    finally:
        core.reset()
        if tables is not None:
            tables.close()


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_shared_rows_give_the_same_tokens_as_plan_block_ids(tiny_dir, mode):
    expected, _, reads, preemptions = _run(tiny_dir, shared=False, preemption_mode=mode,
                                           num_gpu_blocks=14)
    assert reads == 0 and preemptions > 0
    got, core, reads, _ = _run(tiny_dir, shared=True, preemption_mode=mode, num_gpu_blocks=14)
    assert reads > 0 and core.seqs == {}
    assert got == expected
    assert len(got) == 7 + 3 and all(len(got[("n3", i)]) == 18 for i in range(3))


def test_an_abort_during_a_step_leaves_its_row_readable_until_the_step_is_over(tiny_dir):
    # r0..r3 are running when their aborts arrive; without holding the rows the worker would
    # find them blanked (-1) and fail the step.
    aborts = {3: "r0", 4: "r1", 9: "n3", 12: "r3"}
    got, _, reads, _ = _run(tiny_dir, shared=True, preemption_mode="swap", num_gpu_blocks=64,
                            aborts=aborts)
    expected, _, _, _ = _run(tiny_dir, shared=False, preemption_mode="swap", num_gpu_blocks=64,
                             aborts=aborts)
    assert reads > 0 and got == expected
    assert len(got[("r0", 0)]) < 20          # really cut short


def test_a_row_without_blocks_is_a_clear_error(tiny_dir):
    runner = ModelRunner(load_config(tiny_dir), tiny_dir, torch.float32, "cpu", BLOCK_SIZE, 8)
    from pagedserve.workers.model_runner import SeqStep
    runner.shared_tables = np.full((4, 3), -1, np.int32)
    runner.shared_tables[2, 0] = 5
    with pytest.raises(ValueError, match="shared block table row 2 has no block at index 1"):
        runner.execute([SeqStep(list(range(20)), 0, [], True, table_row=2)])
    runner.shared_tables[2, 1] = 6
    assert runner.execute([SeqStep(list(range(20)), 0, [], True, table_row=2)]).shape[0] == 1
