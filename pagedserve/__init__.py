"""pagedserve: a paged-KV-cache, continuously batching LLM serving engine.

The installed packages live under this name: `pagedserve.pipeline` (the processes and the
public API), `pagedserve.kvmanager`, `pagedserve.workers` and `pagedserve.kernels` (the
repository's top-level folders of the same names, mapped here by pyproject.toml).

    from pagedserve import LLM, SamplingParams
"""
from __future__ import annotations

from pathlib import Path as _Path

__version__ = "0.1.0"

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "EngineClient", "AsyncEngineClient",
           "RequestOutput", "CompletionOutput", "RequestError", "__version__"]


def _in_source_tree() -> bool:
    """Whether this is the repository's pagedserve/ folder, not an installed copy."""
    try:
        return 'name = "pagedserve"' in (_Path(__file__).resolve().parents[1]
                                         / "pyproject.toml").read_text(encoding="utf-8")
    except OSError:
        return False


# Run from a checkout that was never installed (a GPU box given only the source tree), the
# sibling folders are the subpackages. An installed copy (wheel or editable) never looks there.
if _in_source_tree():
    __path__.append(str(_Path(__file__).resolve().parents[1]))


def _drop_checkout_root(path: list[str]) -> None:
    """Remove the repository root from the import path, where `python -m` from a checkout put it:
    its folders `kernels/`, `pipeline/` and `workers/` would shadow installed packages of those
    names (Hugging Face's `kernels`, which transformers imports). Every project process starts
    with `PYTHONSAFEPATH=1`; this only covers a hand-started `python -m pagedserve...`."""
    root = _Path(__file__).resolve().parents[1]
    if _in_source_tree():
        path[:] = [entry for entry in path if _Path(entry or ".").resolve() != root]


_drop_checkout_root(__import__("sys").path)


def __getattr__(name: str):
    # Lazy, so that `import pagedserve.kernels` in a worker does not load the client stack.
    if name in __all__ and name != "__version__":
        from pagedserve import pipeline
        return getattr(pipeline, name)
    raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
