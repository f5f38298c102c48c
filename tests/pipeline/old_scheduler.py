"""The scheduler as it was before the one-rule rewrite (commit BASELINE), loaded from git
history into a package of its own, for the differential test. Deleted with that test once the
rewrite has run in production: the old scheduler is only ever read from history."""
from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

BASELINE = "55e2e12ac1e3e68dd4a0028c724ed6ea580eb73d"
PACKAGE = "pagedserve.pipeline.scheduler"
OLD = "old_scheduler_55e2e12"


def _git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout


def load(repo: Path, into: Path):
    """The old package imported as OLD (its modules' imports of PACKAGE rewritten), or a
    string saying why it cannot be (no git, a shallow clone without BASELINE)."""
    if OLD in sys.modules:
        return sys.modules[OLD]
    try:
        names = _git("ls-tree", "--name-only", f"{BASELINE}:pipeline/scheduler", cwd=repo).split()
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"the pre-rewrite scheduler ({BASELINE[:7]}) is not in this clone's history: {exc}"
    package = into / OLD
    package.mkdir(parents=True, exist_ok=True)
    for name in names:
        if name.endswith(".py"):
            text = _git("show", f"{BASELINE}:pipeline/scheduler/{name}", cwd=repo)
            (package / name).write_text(text.replace(PACKAGE, OLD))
    sys.path.insert(0, str(into))
    try:
        return importlib.import_module(OLD)
    finally:
        sys.path.remove(str(into))
