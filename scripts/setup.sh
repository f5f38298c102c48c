#!/usr/bin/env bash
# Idempotent set-up: creates .venv and installs the project (editable, with the dev extra).
# Sourced by scripts/test.sh and scripts/launch.sh; safe to run on its own. A second run with
# nothing to do only compares a stamp and returns in well under a second.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${PAGEDSERVE_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
STAMP="$VENV/.pagedserve-installed"
want="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup.sh" | sha256sum | cut -d' ' -f1)"

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating $VENV" >&2
    "$PY" -m venv "$VENV"
fi
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$want" ]; then
    echo "[setup] installing dependencies into $VENV" >&2
    "$VENV/bin/python" -m pip install -q --upgrade pip
    # torch 2.13.0 resolves to the CPU build kept on this machine's disk; an unpinned torch
    # would download a multi-GB CUDA build.
    "$VENV/bin/python" -m pip install -q "torch==2.13.0"
    "$VENV/bin/python" -m pip install -q -e "$ROOT[dev]"
    echo "$want" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
export VIRTUAL_ENV="$VENV"
