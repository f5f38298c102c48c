"""The layers of pagedserve hold (docs/ARCHITECTURE.md, "Layers"): no import circle between any two
modules, the ground (pagedserve/*.py) imports no role at module level, the contracts import
nothing of the roles, and a worker, detokenizer or ingress process loads no scheduler or
kvmanager module (issue 39).

The graph is read from the sources (module-level and function-level imports, not those under
`if TYPE_CHECKING:`), resolved to `pagedserve.*` names through pyproject's package-dir map.
Importing `a.b.c` also runs the package `a.b`, so that is an edge too."""
import ast
import functools
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from pagedserve import envs

ROOT = Path(__file__).resolve().parents[1]
ROLES = ("pagedserve.pipeline", "pagedserve.workers", "pagedserve.kvmanager", "pagedserve.kernels")
CONTRACTS = ("pagedserve.pipeline.config", "pagedserve.pipeline.messages",
             "pagedserve.pipeline.sampling_params", "pagedserve.pipeline.outputs",
             "pagedserve.pipeline.speculative_config", "pagedserve.pipeline.load_error",
             "pagedserve.pipeline.structured.spec", "pagedserve.pipeline.pooling",
             "pagedserve.pipeline.lora_request", "pagedserve.pipeline.lora_config")
# What a contract may load besides the ground and the other contracts: the packages around them.
CONTRACT_PACKAGES = ("pagedserve.pipeline", "pagedserve.pipeline.structured")


def _modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the installed packages -> (its file, whether it is a package)."""
    folders = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    found = {}
    for package, folder in folders.items():
        base = ROOT / folder
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if not all((base.joinpath(*parts[:i]) / "__init__.py").exists()
                       for i in range(len(parts))):
                continue    # in a folder that is not a package
            is_package = parts[-1] == "__init__"
            name = ".".join([package, *parts[:-1]] if is_package else [package, *parts])
            found[name] = (path, is_package)
    return found


MODULES = _modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(name: str) -> list[tuple[str, int, bool]]:
    """(imported module, line, at module level) for each pagedserve import of module `name`."""
    path, is_package = MODULES[name]
    package = name if is_package else name.rpartition(".")[0]
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue                      # annotations only: never runs
            if isinstance(child, ast.Import):
                targets = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[:len(package.split(".")) - child.level + 1]
                    base = ".".join(up + ([child.module] if child.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                           for a in child.names]
            else:
                visit(child, top and not isinstance(
                    child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))
                continue
            for target in targets:
                if target.split(".")[0] == "pagedserve" and (resolved := _resolve(target)):
                    found.append((resolved, child.lineno, top))

    visit(ast.parse(path.read_text(encoding="utf-8"), str(path)), True)
    return found


@functools.cache
def _graph(module_level_only: bool = False) -> dict[str, dict[str, int]]:
    """module -> {module it imports: line}, with the packages each import runs."""
    graph: dict[str, dict[str, int]] = {}
    for name in MODULES:
        edges = graph.setdefault(name, {})
        for target, line, top in _imports(name):
            if module_level_only and not top:
                continue
            parts = target.split(".")
            runs = [".".join(parts[:i]) for i in range(2, len(parts))] + [target]
            for module in runs:   # the packages above the target, unless they hold us already
                if module != name and module in MODULES and not name.startswith(module + "."):
                    edges.setdefault(module, line)
    return graph


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One circle from each strongly connected group of two or more modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while (w := stack.pop()) != v:
                group.add(w)
            if group:
                groups.append(group | {v})

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for v in sorted(graph):
        if v not in index:
            connect(v)
    circles = []
    for group in groups:        # the shortest way from the group's first module back to it
        start = min(group)
        came_from: dict[str, str] = {}
        todo = [start]
        while start not in came_from:
            v = todo.pop(0)
            for w in sorted(graph[v]):
                if w in group and w not in came_from:
                    came_from[w] = v
                    todo.append(w)
        circle = [start]
        while (v := came_from[circle[-1]]) != start:
            circle.append(v)
        circles.append([start, *reversed(circle[1:]), start])
    return circles


def _closure(start: str, graph: dict[str, dict[str, int]]) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for w in graph[todo.pop()]:
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


def _is_ground(name: str) -> bool:
    return name == "pagedserve" or (name.count(".") == 1 and not name.startswith(ROLES))


def test_the_walk_sees_the_packages_and_their_imports():
    assert {"pagedserve.transport", "pagedserve.pipeline.scheduler.scheduler",
            "pagedserve.workers.process", "pagedserve.kvmanager.manager"} <= set(MODULES)
    assert "pagedserve.pipeline.messages" in _graph()["pagedserve.workers.core"]


def test_no_import_circle_between_modules():
    graph = _graph()
    described = [" -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(c, c[1:])) + f" -> {c[-1]}"
                 for c in _cycles(graph)]
    assert described == []


def test_the_ground_imports_no_role_at_module_level():
    graph = _graph(module_level_only=True)
    upward = [f"{name}:{line} imports {target}" for name in sorted(graph) if _is_ground(name)
              for target, line in graph[name].items() if target.startswith(ROLES)]
    assert upward == []


@pytest.mark.parametrize("contract", CONTRACTS)
def test_a_contract_loads_only_the_ground_and_other_contracts(contract):
    graph = _graph(module_level_only=True)
    loaded = _closure(contract, graph)
    above = sorted(m for m in loaded
                   if not _is_ground(m) and m not in CONTRACTS and m not in CONTRACT_PACKAGES)
    assert above == []


PROBE = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
print(json.dumps(sorted(m for m in sys.modules
                        if m.startswith(("pagedserve.pipeline.scheduler", "pagedserve.kvmanager")))))
"""


@pytest.mark.parametrize("process", ["pagedserve.workers.process",
                                     "pagedserve.pipeline.detokenizer.process",
                                     "pagedserve.pipeline.ingress.process"])
def test_a_role_process_loads_no_scheduler_or_kvmanager_module(process):
    done = subprocess.run([sys.executable, "-c", PROBE, process], cwd=ROOT,
                          env=envs.child_environ(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
