"""bench_throughput's transformers baseline: a sweep over batch sizes (the best one reported,
every one in the JSON) on all requests or a seeded random sample of them, not the first K."""
import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_throughput as bench  # noqa: E402


def requests(n: int) -> list:
    return [bench.BenchRequest([i, i + 1, i + 2, i + 3], 4 + i % 5) for i in range(n)]


def test_sweep_reports_the_best_batch_size_and_every_size():
    useful = {8: 10.0, 16: 30.0, 32: 20.0, 64: 5.0}
    ran = []

    def run_static(size):
        ran.append(size)
        return {"output_tok_s": useful[size], "requests": 40}

    best, sweep = bench.sweep_batch_sizes(run_static, [8, 16, 32, 64])
    assert ran == [8, 16, 32, 64]
    assert best["batch_size"] == 16 and best["output_tok_s"] == 30.0
    assert [(s["batch_size"], s["output_tok_s"]) for s in sweep] == list(useful.items())


def test_sample_is_random_seeded_and_in_arrival_order():
    reqs = requests(50)
    chosen, what = bench.hf_sample(reqs, 8, seed=3)
    assert len(chosen) == 8 and chosen != reqs[:8]  # not the first K
    positions = [reqs.index(r) for r in chosen]
    assert positions == sorted(positions)
    assert "random sample of 8 of the 50" in what and "seed 3" in what
    assert bench.hf_sample(reqs, 8, seed=3)[0] == chosen
    assert bench.hf_sample(reqs, 8, seed=4)[0] != chosen
    assert bench.hf_sample(reqs, None, seed=3) == (reqs, "all 50 requests")
    assert bench.hf_sample(reqs, 50, seed=3)[0] is reqs


def test_compare_with_hf_puts_the_whole_sweep_in_the_json(monkeypatch):
    import transformers

    class Model:
        def to(self, device):
            return self

        def eval(self):
            return self

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: Model())
    monkeypatch.setattr(bench, "_generate_batch", lambda *a, **k: None)
    rate = {8: 12.0, 16: 18.0, 32: 15.0}

    def fake_static(hf, reqs, device, size, pad_id):
        return {"output_tok_s": rate[size], "requests_s": 1.0, "elapsed_s": 2.0,
                "requests": len(reqs), "output_tokens": 60, "padded_output_tokens": 64}

    monkeypatch.setattr(bench, "run_hf_static", fake_static)
    args = argparse.Namespace(hf_num_prompts=6, hf_batch_sizes="8,16,32", seed=0)
    tokenizer = argparse.Namespace(pad_token_id=0, eos_token_id=2)
    report = bench.compare_with_hf(requests(20), args, Path("."), tokenizer, None, "cpu", 90.0)
    assert report["hf_best_batch_size"] == 16 and report["hf_static_output_tok_s"] == 18.0
    assert report["ratio_vs_hf"] == pytest.approx(5.0)
    assert [s["batch_size"] for s in report["hf_sweep"]] == [8, 16, 32]
    assert report["hf_num_prompts"] == 6 and report["hf_extrapolated"] is True
    assert "random sample of 6 of the 20" in report["hf_sample"]
