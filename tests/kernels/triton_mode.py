"""Whether the Triton kernels run in this process: compiled on a CUDA GPU, or in Triton's
interpreter on CPU. Its own module, not conftest.py: a run that also collects tests/workers
imports that folder's conftest under the same name, and `from conftest import ...` would find
the wrong one."""
import importlib

import torch

# the kernels' names -> (their module under pagedserve.kernels, the Triton kernel in it)
KERNEL_MODULES = {
    "store_kv": ("triton_store_kv", "_store_kv_kernel"),
    "paged_decode_attention": ("triton_decode_attention", "_paged_decode_kernel"),
    "paged_prefill_attention": ("triton_prefill_attention", "_paged_prefill_kernel"),
    "copy_blocks": ("triton_copy_blocks", "_copy_blocks_kernel"),
}

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def kernel_modules():
    return {name: importlib.import_module(f"pagedserve.kernels.{module}")
            for name, (module, _) in KERNEL_MODULES.items()}


def triton_runs_here() -> bool:
    """True on a GPU, or on CPU when every kernel was decorated for the interpreter."""
    if DEVICE == "cuda":
        return True
    from triton.runtime.interpreter import InterpretedFunction
    modules = kernel_modules()
    return all(isinstance(getattr(modules[name], kernel), InterpretedFunction)
               for name, (_, kernel) in KERNEL_MODULES.items())


def run_in_interpreter(path: str, select: str) -> None:
    """Run the tests of `path` that `select` (a pytest -k expression) picks in a fresh process
    under TRITON_INTERPRET=1 (this one imported triton without it), and assert they all passed."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "-k", select, path], env=env, capture_output=True, text=True,
                            timeout=300)
    summary = result.stdout.strip().splitlines()[-1]
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in summary and "skipped" not in summary, summary
