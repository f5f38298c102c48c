"""Where the Triton kernel tests run: compiled on a CUDA GPU, else in Triton's interpreter.

triton.jit picks compiled or interpreted when a module (triton.language itself included) is
imported, and some of triton's lazy imports read the flag again at call time, so
TRITON_INTERPRET=1 must be set before the first `import triton` and stay set. This conftest sets
it for the session on a CPU-only host when triton is not imported yet (harmless elsewhere: on
CPU tensors the kernels dispatch to the torch references). When some other test imported triton
first, the Triton tests run in a subprocess instead
(test_kernel_triton.py::test_triton_suite_in_subprocess).
"""
import os
import sys

import pytest
import torch
from triton_mode import DEVICE, kernel_modules, triton_runs_here

if DEVICE == "cpu" and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

from pagedserve.kernels import native  # noqa: E402  (imports triton: after TRITON_INTERPRET)
import native_variants  # noqa: E402  (imports pagedserve.kernels too)


@pytest.fixture(scope="session")
def triton_kernels():
    """The kernel modules, their Triton kernels runnable in this process (else the test skips)."""
    if not triton_runs_here():
        pytest.skip("triton was imported without TRITON_INTERPRET=1 before this conftest; "
                    "test_triton_suite_in_subprocess runs these tests instead")
    return kernel_modules()


@pytest.fixture
def device():
    return torch.device(DEVICE)


@pytest.fixture
def rng():
    """A fresh, randomly seeded generator per test; the seed is printed on failure."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"torch seed {seed}")
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module", params=native.VARIANTS)
def native_variant(request):
    """Each native build variant this machine can build and run, selected for the tests of a
    module (native_variants.PER_VARIANT); one it cannot run skips them with the reason."""
    reason = native.variant_unavailable_reason(request.param)
    if reason is None and request.param == "native":
        reason = native_variants.native_duplicates_a_fixed_variant()
    if reason is not None:
        pytest.skip(reason)
    with native.use_variant(request.param):
        yield request.param
