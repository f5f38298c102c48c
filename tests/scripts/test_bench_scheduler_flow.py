"""scripts/bench_scheduler.py measures a steady flow: admissions, prefill chunks and finishes
happen in the measured cycles, the measured state is not frozen out of the GC unless asked."""
import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_scheduler  # noqa: E402

SMALL = ["--running", "64", "--waiting", "32", "--cycles", "80", "--warmup", "10",
         "--min-output", "4", "--max-output", "40", "--no-store"]


def test_measured_cycles_admit_prefill_and_finish(capsys):
    result = bench_scheduler.main(SMALL)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    # The old benchmark admitted nobody: its waiting queue never got in.
    assert result["admissions"] > 0 and result["finishes"] > 0
    assert result["admissions_per_cycle"] > 0 and result["prefill_tokens_per_cycle"] > 0
    # --running keeps its meaning: that many sequences are scheduled each cycle.
    scheduled = result["decodes_per_cycle"] + result["prefill_chunks_per_cycle"]
    assert 60 <= scheduled <= 64
    assert result["preemptions"] == 0
    assert result["gc_freeze"] is False and len(result["gc_collections"]) == 3
    assert (result["running"], result["waiting"], result["cycles"]) == (64, 32, 80)


def test_fake_workers_sample_only_at_the_end_of_a_prompt():
    from pagedserve.pipeline.messages import NewSeq, ScheduledSeq, StepPlan
    from pagedserve.pipeline.sampling_params import SamplingParams

    workers = bench_scheduler.FakeWorkers()
    new = NewSeq(1, [5] * 10, [], SamplingParams(), [0], 0)
    chunk = StepPlan(0, [new], [ScheduledSeq(1, 6, [], [])], [], [], [], [], [])
    result, mix = workers.step(chunk)
    assert result.seq_ids == [] and mix["prefill_tokens"] == 6 and mix["admissions"] == 1
    rest = StepPlan(1, [], [ScheduledSeq(1, 4, [], [])], [], [], [], [], [])
    result, mix = workers.step(rest)
    assert result.seq_ids == [1] and mix["prefill_chunks"] == 1
    decode = StepPlan(2, [], [ScheduledSeq(1, 1, [], [7])], [], [], [], [], [],
                      decode_seq_ids=[2], decode_token_ids=[7])
    workers.uncomputed[2] = 1
    result, mix = workers.step(decode)
    assert result.seq_ids == [2, 1] and mix["decodes"] == 2 and mix["prefill_chunks"] == 0


def test_gc_freeze_keeps_the_old_measurement_and_leaves_nothing_frozen():
    result = bench_scheduler.main(SMALL + ["--gc-freeze"])
    assert result["gc_freeze"] is True and result["admissions"] > 0
    assert gc.get_freeze_count() == 0
