#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite; arguments go to pytest.
# Quick subset: scripts/test.sh -m "not slow"
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The suite includes lm-evaluation-harness's run against the server: the eval extra's lock.
export PAGEDSERVE_EVAL="${PAGEDSERVE_EVAL:-1}"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
# setup.sh exported PYTHONSAFEPATH=1: `python -m pytest` does not put the repository root on the
# import path (its kernels/ would shadow Hugging Face's kernels package).
exec python -m pytest "$@"
