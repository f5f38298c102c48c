#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite; arguments go to pytest.
# Quick subset: scripts/test.sh -m "not slow"
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec python -m pytest "$@"
