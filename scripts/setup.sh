#!/usr/bin/env bash
# Idempotent set-up: creates .venv, installs the locked dependencies (scripts/lock/, exact
# versions with hashes) and the project itself (editable, no dependency resolution).
# Sourced by scripts/test.sh and scripts/launch.sh; safe to run on its own. A second run with
# nothing to do only compares a stamp and returns in well under a second.
# Refresh the lock with scripts/lock.sh; try the newest releases with scripts/check_newest.py.
# PYTHONSAFEPATH=1: no Python process of ours puts its working directory (a checkout's root,
# whose kernels/ would shadow Hugging Face's kernels package) on its import path.
# PAGEDSERVE_SETUP=skip: use the Python environment already active, as it is (an environment
# you manage yourself, or scripts/check_newest.py's venv of the newest releases).
set -euo pipefail
export PYTHONSAFEPATH=1
if [ "${PAGEDSERVE_SETUP:-}" = "skip" ]; then
    return 0 2>/dev/null || exit 0
fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${PAGEDSERVE_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
STAMP="$VENV/.pagedserve-installed"
LOCK="$ROOT/scripts/lock/linux-$(uname -m).txt"
if [ ! -f "$LOCK" ]; then
    echo "[setup] no lock for $(uname -m) (scripts/lock/ has: $(ls "$ROOT/scripts/lock" | \
        grep -o 'linux-.*\.txt' | tr '\n' ' ')); scripts/lock.sh makes one" >&2
    return 1 2>/dev/null || exit 1
fi
want="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup.sh" "$LOCK" | sha256sum | cut -d' ' -f1)"

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating $VENV" >&2
    "$PY" -m venv "$VENV"
fi
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$want" ]; then
    echo "[setup] installing $(basename "$LOCK") into $VENV" >&2
    if ! "$VENV/bin/python" -m pip install -q --require-hashes -r "$LOCK"; then
        echo "[setup] installing the lock failed. torch's CPU build for x86_64 is not on PyPI:" \
             "where pip finds no torch==2.13.0+cpu, run again with" \
             "PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu" >&2
        return 1 2>/dev/null || exit 1
    fi
    "$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$ROOT"
    echo "$want" > "$STAMP"
fi
# PAGEDSERVE_EVAL=1 (scripts/test.sh sets it): also .venv-eval, lm-evaluation-harness in a
# venv of its own (pyproject.toml's eval extra says why), for tests/e2e/test_lm_eval.py.
if [ "${PAGEDSERVE_EVAL:-0}" = "1" ]; then
    EVAL_VENV="$ROOT/.venv-eval"
    EVAL_LOCK="$ROOT/scripts/lock/eval-linux-$(uname -m).txt"
    eval_want="$(sha256sum < "$EVAL_LOCK" | cut -d' ' -f1)"
    if [ ! -f "$EVAL_VENV/.installed" ] || [ "$(cat "$EVAL_VENV/.installed")" != "$eval_want" ]; then
        echo "[setup] installing $(basename "$EVAL_LOCK") into $EVAL_VENV" >&2
        [ -x "$EVAL_VENV/bin/python" ] || "$PY" -m venv "$EVAL_VENV"
        # pip 23's hash-checking mode refuses a dependency asked for with an extra
        # (dataproperty's typepy[datetime]) although the lock pins it; newer pips take it
        "$EVAL_VENV/bin/python" -m pip install -q "pip==26.3"
        "$EVAL_VENV/bin/python" -m pip install -q --require-hashes -r "$EVAL_LOCK"
        echo "$eval_want" > "$EVAL_VENV/.installed"
    fi
fi
export PATH="$VENV/bin:$PATH"
export VIRTUAL_ENV="$VENV"
