#!/usr/bin/env bash
# Set up (if needed), fetch the default model on first use, and start the whole process group
# (scheduler, workers, detokenizer, HTTP ingress) serving on port 8000. Flags go to
# `python -m pagedserve.pipeline.launch` and follow vLLM's names, e.g.:
#   scripts/launch.sh --tensor-parallel-size 2 --max-num-seqs 128 --port 8001
#   scripts/launch.sh --model Qwen2.5-Coder-0.5B-Instruct   (built-ins: workers/builtin_models.py, builtin_dirs.py)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
# From the caller's directory (a relative --model path is theirs); setup.sh exported
# PYTHONSAFEPATH=1, so no directory is put on the import path by `python -m`.
exec python -m pagedserve.pipeline.launch "$@"
