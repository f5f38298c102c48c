"""Run by tests/e2e/test_lm_eval.py with .venv-eval's Python (lm-evaluation-harness lives
there, not in the project's venv): lm-eval's simple_evaluate of one model on the task in this
folder; prints {"acc", "acc_norm", "loglikelihoods": per document, per choice} as JSON.
Usage: run_lm_eval.py MODEL_TYPE MODEL_ARGS (run from this folder: the data path is relative)."""
import json
import sys
from pathlib import Path

from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager

TASK = "pagedserve_tiny_mc"


def main() -> None:
    model, model_args = sys.argv[1:3]
    out = simple_evaluate(model=model, model_args=model_args, tasks=[TASK], batch_size=1,
                          task_manager=TaskManager(include_path=str(Path(__file__).parent)),
                          log_samples=True)
    samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
    results = out["results"][TASK]
    print(json.dumps({
        "acc": results["acc,none"], "acc_norm": results["acc_norm,none"],
        "loglikelihoods": [[float(r[0]) for r in s["filtered_resps"]] for s in samples]}))


if __name__ == "__main__":
    main()
