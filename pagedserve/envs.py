"""Every environment variable pagedserve reads, in one place, read once.

The launcher reads the environment at start (`from_environ`) and hands the result to every
process it starts inside the engine configuration (`EngineConfig.env`); each process installs it
(`install`) before it builds anything. Library code asks `current()`: the installed settings, or,
in a process no launcher started (the offline API in-process, a script, a test), the
environment read once on first use. Nothing reads the environment at import time.

Tests change settings with `override(...)`, which also clears what was derived from them.

| variable | default | meaning |
|---|---|---|
| PAGEDSERVE_CACHE | ~/.cache/pagedserve | models, compiled native kernels, datasets |
| PAGEDSERVE_LOG_LEVEL | INFO | logging level of every process |
| PAGEDSERVE_API_KEY | (none) | default of --api-key |
| PAGEDSERVE_KERNELS | auto | auto (Triton on CUDA tensors, torch elsewhere), triton, torch |
| PAGEDSERVE_DECODE_CPU | native | CPU decode attention: native (C), bucketed (torch SDPA), ref |
| PAGEDSERVE_ATTENTION_THREADS | 0 | threads of the native decode attention; 0: torch's |
| PAGEDSERVE_FP32_LINEAR | auto | fp32 CPU linears: auto, native (linear_f32.c), onednn |
| PAGEDSERVE_BF16_LINEAR | auto | bf16 CPU linears: auto, native (linear_bf16.c), torch |
| PAGEDSERVE_NATIVE_ELEMENTWISE | 1 | 0: torch's RMSNorm, SiLU-and-mul and RoPE on CPU |
| PAGEDSERVE_PREPACK | 1 | 0: no prepacked CPU linear weights (plain F.linear; GGUF weights kept raw) |
| PAGEDSERVE_CPU_DECODE_REPLAY | 1 | 0: CPU decode steps run eagerly, not replayed (workers/cpu_decode_replay.py) |
| PAGEDSERVE_NATIVE_VARIANT | native | native kernels' build: native (this CPU's best), avx512, avx2 (e.g. an AVX-512 host measuring AVX2), portable |
| PAGEDSERVE_NATIVE_CFLAGS | (none) | extra C compiler flags for the native kernels |
| CC | gcc or cc | the C compiler of the native kernels |
| PAGEDSERVE_STEP_TRACE | (none) | a file: a JSON line per step, its time split across the processes (scripts/step_budget.py) |
| PAGEDSERVE_READY_TIMEOUT | 600 | seconds the launcher waits for every process to be ready |
| PAGEDSERVE_DRAIN_TIMEOUT | 120 | seconds a graceful stop waits for in-flight requests |
| PAGEDSERVE_START_TIMEOUT | 900 | seconds the offline API waits for its engine group |
| PAGEDSERVE_FAULT | (none) | fault injection for tests: see pagedserve/faults.py |

The launcher also sets PAGEDSERVE_ROLE (scheduler, worker0, ...) in each child's environment,
for tools that look for the processes of one role; pagedserve itself never reads it back.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

ROLE_VARIABLE = "PAGEDSERVE_ROLE"

KERNEL_BACKENDS = ("auto", "triton", "torch")
DECODE_CPU_PATHS = ("native", "bucketed", "ref")
FP32_LINEAR_CHOICES = ("auto", "native", "onednn")
BF16_LINEAR_CHOICES = ("auto", "native", "torch")
NATIVE_VARIANTS = ("native", "avx512", "avx2", "portable")   # kernels/native/variants.py's


@dataclass(frozen=True, slots=True)
class Environment:
    cache_dir: str = ""                 # "" -> ~/.cache/pagedserve
    log_level: str = "INFO"
    api_key: str | None = None
    kernels: str = "auto"
    decode_cpu: str = "native"
    attention_threads: int = 0
    fp32_linear: str = "auto"
    bf16_linear: str = "auto"
    native_elementwise: bool = True
    prepack: bool = True
    cpu_decode_replay: bool = True
    native_variant: str = "native"
    native_cflags: str = ""
    cc: str = ""
    step_trace: str = ""
    ready_timeout: float = 600.0
    drain_timeout: float = 120.0
    start_timeout: float = 900.0
    fault: str = ""

    def __post_init__(self) -> None:
        for name, choices in (("kernels", KERNEL_BACKENDS), ("decode_cpu", DECODE_CPU_PATHS),
                              ("fp32_linear", FP32_LINEAR_CHOICES),
                              ("bf16_linear", BF16_LINEAR_CHOICES),
                              ("native_variant", NATIVE_VARIANTS)):
            value = getattr(self, name)
            if value not in choices:
                raise ValueError(f"{_VARIABLES[name]}={value!r}: expected one of "
                                 f"{', '.join(choices)}")
        if self.attention_threads < 0:
            raise ValueError(f"PAGEDSERVE_ATTENTION_THREADS must be >= 0, got "
                             f"{self.attention_threads}")
        for name in ("ready_timeout", "drain_timeout", "start_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{_VARIABLES[name]} must be positive seconds, got "
                                 f"{getattr(self, name)}")

    @property
    def cache_root(self) -> Path:
        """Where models, compiled kernels and datasets are cached."""
        return Path(self.cache_dir).expanduser() if self.cache_dir else (
            Path.home() / ".cache" / "pagedserve")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# field -> variable name
_VARIABLES = {
    "cache_dir": "PAGEDSERVE_CACHE", "log_level": "PAGEDSERVE_LOG_LEVEL",
    "api_key": "PAGEDSERVE_API_KEY", "kernels": "PAGEDSERVE_KERNELS",
    "decode_cpu": "PAGEDSERVE_DECODE_CPU", "attention_threads": "PAGEDSERVE_ATTENTION_THREADS",
    "fp32_linear": "PAGEDSERVE_FP32_LINEAR", "bf16_linear": "PAGEDSERVE_BF16_LINEAR",
    "native_elementwise": "PAGEDSERVE_NATIVE_ELEMENTWISE", "prepack": "PAGEDSERVE_PREPACK",
    "cpu_decode_replay": "PAGEDSERVE_CPU_DECODE_REPLAY",
    "native_variant": "PAGEDSERVE_NATIVE_VARIANT",
    "native_cflags": "PAGEDSERVE_NATIVE_CFLAGS", "cc": "CC",
    "step_trace": "PAGEDSERVE_STEP_TRACE", "ready_timeout": "PAGEDSERVE_READY_TIMEOUT",
    "drain_timeout": "PAGEDSERVE_DRAIN_TIMEOUT", "start_timeout": "PAGEDSERVE_START_TIMEOUT",
    "fault": "PAGEDSERVE_FAULT",
}
VARIABLES: tuple[str, ...] = tuple(_VARIABLES.values()) + (ROLE_VARIABLE,)


def _parse(name: str, text: str):
    field_type = {f.name: f.type for f in dataclasses.fields(Environment)}[name]
    variable = _VARIABLES[name]
    try:
        if field_type == "bool":
            if text not in ("0", "1"):
                raise ValueError("expected 0 or 1")
            return text == "1"
        if field_type == "int":
            return int(text or 0)
        if field_type == "float":
            return float(text)
    except ValueError as exc:
        raise ValueError(f"{variable}={text!r}: {exc}") from None
    return text


def from_environ(environ: Mapping[str, str] | None = None) -> Environment:
    """The settings the environment gives (unset variables keep their defaults); a bad value
    raises ValueError naming the variable."""
    environ = os.environ if environ is None else environ
    values = {name: _parse(name, environ[variable]) for name, variable in _VARIABLES.items()
              if variable in environ and (environ[variable] or name in ("api_key",))}
    if values.get("api_key") == "":
        values["api_key"] = None
    return Environment(**values)


def from_dict(values: Mapping) -> Environment:
    return Environment(**values)


_current: Environment | None = None
_listeners: list[Callable[[], None]] = []


def current() -> Environment:
    """This process's settings: the installed ones, else the environment read once."""
    global _current
    if _current is None:
        _current = from_environ()
    return _current


def install(env: Environment) -> None:
    """Make `env` this process's settings (a role does this first, with its config's)."""
    global _current
    changed = env != _current
    _current = env
    if changed:
        for listener in _listeners:
            listener()


def on_change(listener: Callable[[], None]) -> Callable[[], None]:
    """Call `listener` whenever the settings change (to drop what was derived from them)."""
    _listeners.append(listener)
    return listener


@contextlib.contextmanager
def override(**changes) -> Iterator[Environment]:
    """Tests: these settings changed for the duration of the block."""
    before = current()
    env = dataclasses.replace(before, **changes)
    install(env)
    try:
        yield env
    finally:
        install(before)


# Variables that hold secrets: read once by the process a user starts, never handed to a
# child, whose environment any process of the same user (and root) can read in /proc.
SECRET_VARIABLES: tuple[str, ...] = (_VARIABLES["api_key"],)


def child_environ(base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """The environment of a Python process the group starts: the parent's (or `base`) plus
    `extra`, less SECRET_VARIABLES (a launcher's children get the key in their config file;
    a router's engine groups need none), with PYTHONSAFEPATH=1, so that the child's working
    directory (a checkout's root, whose `kernels/` and `pipeline/` folders would shadow
    installed packages) is never put on its import path by `python -m`."""
    environ = dict(os.environ if base is None else base, **extra)
    for variable in SECRET_VARIABLES:
        environ.pop(variable, None)
    environ["PYTHONSAFEPATH"] = "1"
    return environ
