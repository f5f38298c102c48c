"""scripts/bench_throughput.py runs end to end on a few short requests (engine + transformers)."""
import json

import pytest

from script_module import load_script

bench = load_script("bench_throughput")

KEYS = {"output_tok_s", "hf_static_output_tok_s", "ratio_vs_hf", "roofline_tok_s",
        "frac_of_roofline", "num_prompts"}


@pytest.mark.slow
def test_bench_throughput_last_line_is_the_json_report(capsys):
    report = bench.main(["--num-prompts", "4", "--hf-num-prompts", "2", "--hf-batch-sizes", "1,2",
                         "--max-prompt-len", "128", "--max-total-len", "192",
                         "--kv-cache-memory", "128MiB", "--max-num-seqs", "8",
                         "--roofline-tokens", "32", "--no-store"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    parsed = json.loads(last)
    assert KEYS <= parsed.keys()
    assert parsed == report
    assert parsed["num_prompts"] == 4 and parsed["hf_num_prompts"] == 2
    assert parsed["hf_extrapolated"] is True
    assert [r["batch_size"] for r in parsed["hf_sweep"]] == [1, 2]
    assert parsed["hf_best_batch_size"] in (1, 2)
    assert parsed["roofline"].startswith("bfloat16 matmuls")
    assert parsed["output_tok_s"] > 0 and parsed["hf_static_output_tok_s"] > 0
    assert parsed["ratio_vs_hf"] == pytest.approx(
        parsed["output_tok_s"] / parsed["hf_static_output_tok_s"], rel=0.02)


@pytest.mark.slow
def test_bench_throughput_in_process_stores_its_result(tmp_path, monkeypatch, capsys):
    import bench_record
    monkeypatch.setattr(bench_record, "RESULTS", tmp_path)
    report = bench.main(["--num-prompts", "3", "--skip-hf", "--max-prompt-len", "64",
                         "--max-total-len", "128", "--kv-cache-memory", "64MiB",
                         "--max-num-seqs", "4", "--roofline-tokens", "16", "--in-process",
                         "--dtype", "float32"])
    assert report["in_process"] is True and report["output_tok_s"] > 0
    (stored,) = (tmp_path / "bench_throughput").glob("*.json")
    record = json.loads(stored.read_text())
    assert record["result"] == report and "--in-process" in record["command"]
    assert record["machine"]["cores"] >= 1 and record["commit"]
