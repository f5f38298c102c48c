"""Every benchmark script takes --no-store and stores its last JSON line otherwise
(scripts/bench_record.py), and --help works."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

SCRIPTS = ["bench_scheduler", "bench_kvmanager", "bench_kernels", "bench_step",
           "bench_throughput", "bench_serving", "compare_llama_server", "bench_decode_replay",
           "profile_step", "bench_perplexity", "bench_lora", "ab_commits", "bench_isa_limits"]


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_names_no_store(name, capsys):
    module = __import__(name)
    with pytest.raises(SystemExit) as done:
        module.main(["--help"])
    assert done.value.code == 0
    assert "--no-store" in capsys.readouterr().out


def test_bench_record_finish_stores_then_prints_the_json_last(tmp_path, monkeypatch, capsys):
    import bench_record
    monkeypatch.setattr(bench_record, "RESULTS", tmp_path)
    bench_record.finish("bench_x", {"a": 1}, no_store=False, argv=["--flag"])
    out = capsys.readouterr().out.strip().splitlines()
    assert json.loads(out[-1]) == {"a": 1} and out[0].startswith("stored in ")
    (stored,) = (tmp_path / "bench_x").glob("*.json")
    record = json.loads(stored.read_text())
    assert record["result"] == {"a": 1} and record["command"] == "python scripts/bench_x.py --flag"
    bench_record.finish("bench_y", {"b": 2}, no_store=True)
    assert not (tmp_path / "bench_y").exists()
    assert capsys.readouterr().out.strip() == '{"b": 2}'


def test_bench_kernels_stores_its_result(tmp_path, monkeypatch, capsys):
    import bench_kernels
    import bench_record
    monkeypatch.setattr(bench_record, "RESULTS", tmp_path)
    result = bench_kernels.main(["--batch", "2", "--context", "32", "--repeats", "1"])
    (stored,) = (tmp_path / "bench_kernels").glob("*.json")
    assert json.loads(stored.read_text())["result"] == result
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result


def test_profile_step_parts_add_up_to_the_traced_step(tmp_path):
    import profile_step
    from pagedserve.workers.testing import make_tiny_llama
    model_dir = make_tiny_llama(tmp_path / "m", seed=1)
    report = profile_step.main(["--model", str(model_dir), "--batch-sizes", "1,3",
                                "--context", "40", "--prefill-chunk", "24", "--copy-mib", "16",
                                "--no-store"])
    for shape in ("decode_b1", "decode_b3", "prefill_24"):
        parts = report[shape]["parts_ms"]
        assert set(parts) == {*profile_step.FAMILIES, "lm_head", "attention", "rest"}
        assert all(v > 0 for k, v in parts.items() if k != "rest"), (shape, parts)
        assert abs(sum(parts.values()) - report[shape]["traced_ms"]) < 0.05, (shape, parts)
    assert report["decode_b3"]["sample_ms"] > 0 and report["floor_ms"] > 0
    assert report["weight_mb"] > 0 and 0 < report["b1_share_of_floor"]


def test_bench_scheduler_no_store_writes_nothing(tmp_path, monkeypatch):
    import bench_record
    import bench_scheduler
    monkeypatch.setattr(bench_record, "RESULTS", tmp_path)
    bench_scheduler.main(["--running", "16", "--waiting", "8", "--cycles", "5", "--warmup", "1",
                          "--min-output", "2", "--max-output", "8", "--no-store"])
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_bench_kvmanager_stores_its_result(tmp_path, monkeypatch):
    """Loads the default model's tokenizer (fetched on a fresh machine)."""
    import bench_kvmanager
    import bench_record
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kvmanager"))
    from test_sharegpt_reader import write_truncated
    monkeypatch.setattr(bench_record, "RESULTS", tmp_path / "results")
    data = tmp_path / "sharegpt.json"
    write_truncated(data, 200)
    result = bench_kvmanager.main(["--num-seqs", "8", "--samples", "150", "--budget-tokens",
                                   "256", "--max-model-len", "64", "--dataset", str(data),
                                   "--decode-steps", "2"])
    (stored,) = (tmp_path / "results" / "bench_kvmanager").glob("*.json")
    assert json.loads(stored.read_text())["result"] == result
    assert "seeded uniform sample of 150" in result["sharegpt_sample"]


def test_bench_decode_replay_times_both_ways_with_the_same_logits(capsys):
    import bench_decode_replay
    report = bench_decode_replay.main(["--batch-sizes", "1,3", "--context", "40", "--steps", "2",
                                       "--rounds", "2", "--no-store"])
    assert [row["batch"] for row in report["batches"]] == [1, 3]
    for row in report["batches"]:
        assert row["same_logits"] and len(row["replay_runs_ms"]) == len(row["eager_runs_ms"]) == 2
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == report
