"""The distribution installs one top-level name, pagedserve; nothing else is shadowed."""
import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAPPED = {"pipeline", "kvmanager", "workers", "kernels", "pagedserve"}


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_package_folder_is_listed_under_pagedserve():
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    found = set()
    for top in MAPPED:
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT).parts
            found.add(".".join(("pagedserve",) + (rel[1:] if top == "pagedserve" else rel)))
    assert found == listed


def test_wheel_installs_only_pagedserve(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(wheels), str(ROOT)], check=True, capture_output=True,
                   timeout=300)
    (wheel,) = wheels.glob("pagedserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"pagedserve"}
    assert "pagedserve/kernels/native/paged_attention.h" in names   # C sources ship too
    assert "pagedserve/pipeline/ingress/webui/index.html" in names   # and the web page
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    code = ("import importlib.util, pagedserve.pipeline, pagedserve.kernels.native\n"
            "assert pagedserve.pipeline.__file__.startswith(%r)\n"
            "for name in ('kernels', 'pipeline', 'workers', 'kvmanager'):\n"
            "    spec = importlib.util.find_spec(name)  # Hugging Face's kernels may be there\n"
            "    assert spec is None or not (spec.origin or '').startswith(%r), name\n"
            % (str(site), str(site)))
    # Only the extracted wheel on the path, run from a folder with no sources in it.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_pagedserve_serve_takes_the_launchers_flags():
    from pagedserve.cli import main
    run = [sys.executable, "-m", "pagedserve.cli"]
    done = subprocess.run([*run, "serve", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "--tensor-parallel-size" in done.stdout
    bad = subprocess.run([*run, "launch"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown command 'launch'" in bad.stderr
    assert main([]) == 2
