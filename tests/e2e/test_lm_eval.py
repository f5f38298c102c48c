"""lm-evaluation-harness (issue 40's acceptance for prompt logprobs): its `local-completions`
model runs a loglikelihood task (multiple choice, defined in tests/e2e/lm_eval_task/ with its
data beside it: nothing is downloaded) against a launched group, and the same harness on
transformers' model of the same weights (`hf`) gives the same accuracy and the same
loglikelihood for every choice. The group prefills in chunks of 16 tokens with the prefix
cache on, which the task's shared questions would hit: both must leave the numbers as they are.

lm-eval lives in .venv-eval (pyproject.toml's eval extra says why), which scripts/test.sh
makes; the harness runs there, as a subprocess."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from pagedserve.pipeline.ingress.testing import make_tiny_tokenizer
from pagedserve.workers.testing import make_tiny_llama
from faults.conftest import Group

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
EVAL_PYTHON = ROOT / ".venv-eval" / "bin" / "python"
TASK_DIR = Path(__file__).parent / "lm_eval_task"


def run_harness(model: str, model_args: str) -> dict:
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", OPENAI_API_KEY="none")
    done = subprocess.run([str(EVAL_PYTHON), "run_lm_eval.py", model, model_args], cwd=TASK_DIR,
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_local_completions_matches_the_harness_on_transformers(tmp_path):
    if not EVAL_PYTHON.exists():
        pytest.skip(f"no {EVAL_PYTHON}: scripts/test.sh (PAGEDSERVE_EVAL=1 scripts/setup.sh) "
                    "makes it")
    model_dir = make_tiny_llama(tmp_path / "tiny", seed=11, vocab_size=259)
    make_tiny_tokenizer().save_pretrained(model_dir)
    group = Group(model_dir, http=True, extra=("--served-model-name", "tiny",
                                               "--max-model-len", "256",
                                               "--max-num-batched-tokens", "16"))
    try:
        served = run_harness("local-completions", ",".join([
            "model=tiny", f"base_url=http://127.0.0.1:{group.port}/v1/completions",
            f"tokenizer={model_dir}", "tokenizer_backend=huggingface", "tokenized_requests=True",
            "num_concurrent=1", "max_retries=1"]))
        stats = group.client.stats()
    finally:
        assert group.close() == 0
    reference = run_harness("hf", f"pretrained={model_dir},dtype=float32,device=cpu")
    assert served["acc"] == reference["acc"] and served["acc_norm"] == reference["acc_norm"]
    assert len(served["loglikelihoods"]) == 8
    for got, want in zip(served["loglikelihoods"], reference["loglikelihoods"]):
        assert got == pytest.approx(want, abs=1e-3)
    worst = max(abs(g - w) for gs, ws in zip(served["loglikelihoods"], reference["loglikelihoods"])
                for g, w in zip(gs, ws))
    print(f"acc {served['acc']}, acc_norm {served['acc_norm']}, largest loglikelihood "
          f"difference {worst:.2e}")
    assert stats["prefix_cache_queries"] > 0  # the cache was on; requests read none of it
