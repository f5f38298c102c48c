"""ModelLoadError: the one error of model resolution and loading (workers.loader, workers.gguf_files).

A module of its own so that workers.gguf_files need not import workers.loader, which imports it: that
would be a cycle, and under `python -m pagedserve.workers.loader` a second copy of the loader whose
ModelLoadError the CLI would not catch.
"""
from __future__ import annotations


class ModelLoadError(Exception):
    """A model could not be resolved or loaded; the message names the path and the problem."""
