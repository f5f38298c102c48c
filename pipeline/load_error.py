"""ModelLoadError: the one error of model resolution and loading.

A contract: the workers' loader raises it (workers/loader.py, gguf_files.py, ...), the launcher,
the tokenizer and the generation defaults catch it, so it lives below both. A module of its own,
so that no loading module imports another only for its error: under
`python -m pagedserve.workers.loader` that would load a second copy of the loader whose
ModelLoadError the CLI would not catch.
"""
from __future__ import annotations


class ModelLoadError(Exception):
    """A model could not be resolved or loaded; the message names the path and the problem."""
