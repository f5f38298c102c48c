"""The repository's top-level folders (`pipeline/ kvmanager/ workers/ kernels/`) are imported only
as `pagedserve.*`, and the repository root is never first on the import path: its `kernels/`
folder once shadowed Hugging Face's `kernels`, which transformers imports (issue 45)."""
import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from pagedserve import envs

ROOT = Path(__file__).resolve().parents[1]
BARE = {"pipeline", "kvmanager", "workers", "kernels"}
SOURCES = ("pagedserve", "pipeline", "kvmanager", "workers", "kernels", "scripts", "tests",
           "benchmarks")


def _bare_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [f"{path.relative_to(ROOT)}:{node.lineno} imports {name}"
                  for name in names if name.split(".")[0] in BARE]
    return found


def test_no_source_imports_a_top_level_folder_by_its_bare_name():
    offenders = [hit for top in SOURCES for path in sorted((ROOT / top).rglob("*.py"))
                 for hit in _bare_imports(path)]
    assert offenders == []


def test_the_root_is_not_on_this_test_process_import_path(path_at_start):
    """`path_at_start` is sys.path as tests/conftest.py found it, before any pagedserve import
    (pagedserve/__init__.py drops the root, which would hide the cause here)."""
    resolved = [Path(entry or os.getcwd()).resolve() for entry in path_at_start]
    assert ROOT not in resolved, path_at_start
    for name in BARE:
        module = sys.modules.get(name)
        origin = Path(getattr(module, "__file__", "") or "/").resolve()
        assert module is None or (ROOT / name) not in origin.parents, origin


def _shadows(tmp_path: Path) -> Path:
    """Packages named like the repository's folders, as another project in the venv might ship
    them: importing one fails loudly."""
    for name in ("pipeline", "workers", "kvmanager"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(
            f"raise ImportError('the unrelated package {name!r} was imported')\n")
    return tmp_path


ALL_MODULES = """
import importlib, json, pkgutil, sys, tomllib
import transformers.integrations.hub_kernels            # imports Hugging Face's kernels
packages = tomllib.load(open(sys.argv[1], 'rb'))['tool']['setuptools']['packages']
skip = ('pagedserve.kernels.triton_', 'pagedserve.kernels.cuda_')
names = []
for package in packages:
    for info in pkgutil.iter_modules(importlib.import_module(package).__path__, package + '.'):
        if info.ispkg or info.name.startswith(skip) or info.name.endswith('__main__'):
            continue
        importlib.import_module(info.name)
        names.append(info.name)
print(json.dumps({"path": sys.path, "imported": len(names)}))
"""


def test_every_module_imports_beside_hub_kernels_and_packages_named_like_our_folders(tmp_path):
    """Started as the launcher starts a group process: `python` from the repository root, with
    envs.child_environ()."""
    env = envs.child_environ(PYTHONPATH=str(_shadows(tmp_path)))
    done = subprocess.run([sys.executable, "-c", ALL_MODULES, str(ROOT / "pyproject.toml")],
                          cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["imported"] > 100
    assert str(ROOT) not in report["path"] and "" not in report["path"]


def test_a_group_process_started_from_the_root_does_not_see_it(tmp_path):
    probe = "import json, sys; print(json.dumps(sys.path))"
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=envs.child_environ(),
                          capture_output=True, text=True, timeout=60, check=True)
    path = json.loads(done.stdout)
    assert str(ROOT) not in path and "" not in path


def test_a_hand_started_module_from_the_root_drops_it():
    """`python -m pagedserve...` typed in a checkout (no PYTHONSAFEPATH): pagedserve's import
    takes the root back off the path before anything else is imported."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    code = ("import sys, json; import pagedserve; "
            "import transformers.integrations.hub_kernels; print(json.dumps(sys.path))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "" not in json.loads(done.stdout) and str(ROOT) not in json.loads(done.stdout)


def test_the_whole_suite_collects_beside_packages_named_like_our_folders(tmp_path):
    """As scripts/test.sh starts pytest, with Hugging Face's `kernels` in the venv and packages
    named `pipeline`, `workers` and `kvmanager` on the path: every test module collects."""
    env = envs.child_environ(PYTHONPATH=str(_shadows(tmp_path)))
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "-p", "no:cacheprovider"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert re.search(r"^\d{4,} tests collected", done.stdout, re.M), done.stdout[-1000:]
