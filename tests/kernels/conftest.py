"""Where the Triton kernel tests run: compiled on a CUDA GPU, else in Triton's interpreter.

triton.jit picks compiled or interpreted when a module (triton.language itself included) is
imported, and some of triton's lazy imports read the flag again at call time, so
TRITON_INTERPRET=1 must be set before the first `import triton` and stay set. This conftest sets
it for the session on a CPU-only host when triton is not imported yet (harmless elsewhere: on
CPU tensors the kernels dispatch to the torch references). When some other test imported triton
first, the Triton tests run in a subprocess instead
(test_kernel_triton.py::test_triton_suite_in_subprocess).
"""
import importlib
import os
import sys

import pytest
import torch

KERNEL_MODULES = {
    "store_kv": "_store_kv_kernel",
    "paged_decode_attention": "_paged_decode_kernel",
    "paged_prefill_attention": "_paged_prefill_kernel",
    "copy_blocks": "_copy_blocks_kernel",
}

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

if DEVICE == "cpu" and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"


def _kernel_modules():
    return {name: importlib.import_module(f"kernels.{name}") for name in KERNEL_MODULES}


def triton_runs_here() -> bool:
    """True on a GPU, or on CPU when every kernel was decorated for the interpreter."""
    if DEVICE == "cuda":
        return True
    from triton.runtime.interpreter import InterpretedFunction
    modules = _kernel_modules()
    return all(isinstance(getattr(modules[name], kernel), InterpretedFunction)
               for name, kernel in KERNEL_MODULES.items())


@pytest.fixture(scope="session")
def triton_kernels():
    """The kernel modules, their Triton kernels runnable in this process (else the test skips)."""
    if not triton_runs_here():
        pytest.skip("triton was imported without TRITON_INTERPRET=1 before this conftest; "
                    "test_triton_suite_in_subprocess runs these tests instead")
    return _kernel_modules()


@pytest.fixture
def device():
    return torch.device(DEVICE)


@pytest.fixture
def rng():
    """A fresh, randomly seeded generator per test; the seed is printed on failure."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"torch seed {seed}")
    return torch.Generator().manual_seed(seed)
