import pytest

from pagedserve.workers.loader import TEST_MODEL, resolve_model


@pytest.fixture(scope="session")
def model_dir():
    return resolve_model(TEST_MODEL)
