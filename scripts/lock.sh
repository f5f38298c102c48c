#!/usr/bin/env bash
# Refresh the lock: exact versions, with hashes, of every direct and transitive dependency of
# pyproject.toml (with the dev extra and the build requirements) for CPython 3.11 on Linux,
# one file per machine type, resolved by uv (pinned below, installed into a throwaway venv).
#   scripts/lock.sh            # writes scripts/lock/{,eval-}linux-{x86_64,aarch64}.txt
# scripts/setup.sh installs from these files; scripts/check_newest.py tries the newest releases.
# torch is the CPU build on both (scripts/lock/extra-ARCH.in): 2.13.0+cpu on x86_64 comes from
# pip's configured find-links here, or from PyTorch's CPU index given as UV_EXTRA_INDEX_URL
# elsewhere; 2.9.1 on aarch64 from PyPI. Notes on the pins: scripts/lock/README.md.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
UV_VERSION="0.13.9"
TOOL="$(mktemp -d)"
trap 'rm -rf "$TOOL"' EXIT
"${PYTHON:-python3}" -m venv "$TOOL/venv"
"$TOOL/venv/bin/python" -m pip install -q "uv==$UV_VERSION"
cd "$ROOT"
links=()
for dir in $(pip config get global.find-links 2>/dev/null || true) ${PIP_FIND_LINKS:-}; do
    [ -d "$dir" ] && links+=(--find-links "$dir")
done
for arch in x86_64 aarch64; do
    "$TOOL/venv/bin/uv" pip compile pyproject.toml "scripts/lock/extra-$arch.in" --extra dev \
        --python-version 3.11 --python-platform "$arch-manylinux_2_28" --generate-hashes \
        --no-header --quiet "${links[@]}" -o "scripts/lock/linux-$arch.txt"
    sed -i "1i # scripts/lock.sh (uv $UV_VERSION) on $(date -u +%F): CPython 3.11, Linux $arch" \
        "scripts/lock/linux-$arch.txt"
    echo "[lock] scripts/lock/linux-$arch.txt: $(grep -c '^[A-Za-z0-9].*==' \
        "scripts/lock/linux-$arch.txt") packages" >&2
    # The eval extra (lm-eval) for its own venv, .venv-eval (pyproject.toml says why): the
    # main lock's versions as constraints, but python-dateutil, which the main lock has at 4
    # and lm-eval's typepy[datetime] wants below 3.
    grep -oE '^[A-Za-z0-9_.-]+==[^ ]+' "scripts/lock/linux-$arch.txt" \
        | grep -v '^python-dateutil==' > "$TOOL/constraints.txt"
    # else uv falls back to pytablewriter 0.38 / typepy 0.3.1, which lacks the [datetime]
    # extra dataproperty asks for: pip's hash-checked install fails
    printf 'python-dateutil<3\npytablewriter>=1.2\n' >> "$TOOL/constraints.txt"
    "$TOOL/venv/bin/uv" pip compile pyproject.toml "scripts/lock/extra-$arch.in" --extra eval \
        -c "$TOOL/constraints.txt" \
        --python-version 3.11 --python-platform "$arch-manylinux_2_28" --generate-hashes \
        --no-header --quiet "${links[@]}" -o "scripts/lock/eval-linux-$arch.txt"
    sed -i "1i # scripts/lock.sh (uv $UV_VERSION) on $(date -u +%F): CPython 3.11, Linux $arch, the eval extra (no dev)" \
        "scripts/lock/eval-linux-$arch.txt"
    echo "[lock] scripts/lock/eval-linux-$arch.txt: $(grep -c '^[A-Za-z0-9].*==' \
        "scripts/lock/eval-linux-$arch.txt") packages" >&2
done
