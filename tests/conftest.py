import os
import sys

import pytest

# The import path as pytest left it, before any test imported pagedserve (whose __init__ would
# drop the repository root from it): tests/test_import_isolation.py checks it.
_PATH_AT_START = list(sys.path)

# Tests run on 2 cores; keep torch from oversubscribing when several processes run at once.
os.environ.setdefault("OMP_NUM_THREADS", "2")
# Every Python process a test starts keeps its working directory (the repository root, whose
# kernels/ would shadow Hugging Face's kernels) off its import path, however it is started.
os.environ["PYTHONSAFEPATH"] = "1"


@pytest.fixture(scope="session")
def path_at_start() -> list[str]:
    return _PATH_AT_START
