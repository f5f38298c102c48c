"""Fixtures for multi-process tests: real process groups on the default model."""
from __future__ import annotations

import os

import psutil
import pytest

from pagedserve.workers.loader import TEST_MODEL, resolve_model

from pagedserve.pipeline.tokenizer import load_tokenizer


@pytest.fixture(scope="session")
def model_dir():
    return resolve_model(TEST_MODEL)


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


def our_processes() -> list[psutil.Process]:
    """Every live process running one of our role modules."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "-m pagedserve.pipeline." in cmd or "-m pagedserve.workers." in cmd:
            if p.pid != os.getpid():
                found.append(p)
    return found


def shm_segments(prefix: str = "pagedserve-") -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]


@pytest.fixture(scope="module")
def llm_bf16(model_dir):
    """One TP=1 group shared by the tests of a module (the dtype `auto` picks for this host). Its
    KV cache is fp8, so these tests also run swap, abort and streaming over an fp8 cache."""
    from pagedserve.pipeline import LLM
    llm = LLM(model=str(model_dir), max_num_seqs=256, kv_cache_memory="512MiB", swap_space=0.25,
              kv_cache_dtype="fp8")
    yield llm
    llm.close()
