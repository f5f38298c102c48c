"""scripts/ab_commits.py serves a revision from its own worktree: the import root it builds
makes `pagedserve.*` that worktree's code in a child process, not this checkout's."""
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

ROOT = Path(__file__).resolve().parents[2]


def test_import_root_serves_the_worktrees_code(tmp_path):
    import ab_commits
    try:
        commit = ab_commits.resolve("HEAD")
    except subprocess.CalledProcessError:
        pytest.skip("not a git checkout with history")
    workdir = tmp_path / "trees"
    workdir.mkdir()
    tree = workdir / commit[:12]
    try:
        root = ab_commits.import_root(commit, workdir)
        ab_commits.check_import("head", root, tree)   # raises SystemExit when it is not
        assert (root / "pagedserve" / "pipeline").resolve() == (tree / "pipeline").resolve()
        with pytest.raises(SystemExit, match="imports from"):
            ab_commits.check_import("other", root, ROOT / "nowhere")
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT,
                       capture_output=True)
