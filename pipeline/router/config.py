"""The router's command line: `pagedserve serve` with `--data-parallel-size N`, several
`--model`s, a `--models-file` or `--engine-url`s starts the router instead of one group; with
no model named, it serves the launcher's default model (`ModelArgs.model`), as a plain launch.

Router flags are parsed here; every other flag is the engine groups' (passed to each
launcher as it is: `--dtype`, `--kv-cache-memory` ...).

API keys come from `--api-key-file` (a file of ours, mode 0600, one `KEY[:RPM[:TPM[:PRIORITY]]]`
a line), `--api-key` (which shows the key to every local user in the process list), or else
$PAGEDSERVE_API_KEY (one key, no limits). No error message repeats a key.

Priority: the engines run lower `priority` values first. A request may ask for no lower value
than its key's PRIORITY (default 0: no client jumps ahead of requests that name none); lower
values are raised to it.
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field

from pagedserve import envs
from pagedserve.pipeline.config import ModelArgs
from pagedserve.pipeline.router.groups import GroupSpec
from pagedserve.pipeline.router.priority import DEFAULT_PRIORITY_FLOOR
from pagedserve.pipeline.router.ratelimit import KeyLimit
from pagedserve.private_files import read_private

_ROUTER_FLAGS = ("--data-parallel-size", "--engine-url", "--models-file", "--max-loaded-models",
                 "--preload")


def wants_router(argv: list[str]) -> bool:
    """Whether a `pagedserve serve` command line asks for the router rather than one group."""
    names = [a.split("=", 1)[0] for a in argv]
    return any(flag in names for flag in _ROUTER_FLAGS) or names.count("--model") > 1


@dataclass(slots=True)
class RouterConfig:
    models: dict[str, GroupSpec] = field(default_factory=dict)   # local models by served name
    engine_urls: list[str] = field(default_factory=list)          # remote engines
    data_parallel_size: int = 1
    max_loaded_models: int | None = None
    preload: list[str] = field(default_factory=list)
    api_keys: dict[str, KeyLimit] = field(default_factory=dict)
    burst_seconds: float = 60.0
    host: str = "0.0.0.0"
    port: int = 8000
    routing: str = "affinity"
    load_factor: float = 1.25
    load_floor: int = 512
    block_size: int = 16
    affinity_blocks: int = 4
    stall_timeout: float = 60.0
    load_timeout: float = 300.0
    ready_timeout: float = 600.0
    replica_wait: float = 30.0
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if not self.models and not self.engine_urls:
            raise ValueError("the router needs --model (one or more), --models-file or --engine-url")
        if self.models and self.engine_urls:
            raise ValueError("give either local models (--model, --models-file) or remote engines "
                             "(--engine-url), not both")
        unknown = [m for m in self.preload if m not in self.models]
        if unknown:
            raise ValueError(f"--preload names {', '.join(unknown)}, which --model does not serve "
                             f"(served: {', '.join(self.models)})")
        if self.max_loaded_models is not None and len(self.preload) > self.max_loaded_models:
            raise ValueError(f"--preload names {len(self.preload)} models but "
                             f"--max-loaded-models is {self.max_loaded_models}")
        if self.routing not in ("affinity", "round-robin"):
            raise ValueError(f"--routing must be affinity or round-robin, got {self.routing!r}")


def parse_api_key(text: str, source: str = "--api-key") -> tuple[str, KeyLimit]:
    """`KEY[:RPM[:TPM[:PRIORITY]]]`: a key, its requests and tokens per minute (empty:
    unlimited) and the most urgent priority it may ask for (empty: 0; priority.py).
    An error names `source` and the limits, never the key (errors are logged)."""
    key, *limits = text.strip().split(":")
    if not key or len(limits) > 3:
        raise ValueError(f"{source}: expected KEY, KEY:RPM, KEY:RPM:TPM or KEY:RPM:TPM:PRIORITY")
    rates, floor = limits[:2], limits[2:]
    try:
        rates = [float(x) if x else None for x in rates] + [None] * (2 - len(rates))
    except ValueError:
        raise ValueError(f"{source}: the limits {':'.join(limits[:2])!r} must be numbers per "
                         "minute") from None
    if any(r is not None and r <= 0 for r in rates):
        raise ValueError(f"{source}: a limit must be positive, got {':'.join(limits[:2])!r}")
    try:
        priority_floor = int(floor[0]) if floor and floor[0] else DEFAULT_PRIORITY_FLOOR
    except ValueError:
        raise ValueError(f"{source}: the priority floor {floor[0]!r} must be an integer "
                         "(lower runs first)") from None
    return key, KeyLimit(rates[0], rates[1], priority_floor)


def read_api_key_file(path: str) -> dict[str, KeyLimit]:
    """One `KEY[:RPM[:TPM]]` a line (blank lines and `#` comments skipped), from a file of ours
    that no one else may read; ValueError naming the file and line otherwise."""
    keys = {}
    for number, line in enumerate(read_private(path, "--api-key-file").splitlines(), 1):
        if line.strip() and not line.lstrip().startswith("#"):
            key, limit = parse_api_key(line, f"--api-key-file {path} line {number}")
            keys[key] = limit
    if not keys:
        raise ValueError(f"--api-key-file {path} holds no key")
    return keys


def api_keys(flags: list[str], key_file: str | None) -> dict[str, KeyLimit]:
    """The file's keys and the flags' (a key given twice keeps its last limits); none given:
    $PAGEDSERVE_API_KEY without limits, as an engine takes it."""
    keys = read_api_key_file(key_file) if key_file else {}
    keys.update(parse_api_key(k) for k in flags)
    default = envs.current().api_key
    if not keys and default:
        keys[default] = KeyLimit(None, None)
    return keys


def parse_model(text: str, engine_args: tuple[str, ...]) -> GroupSpec:
    """`SOURCE` (served as its base name) or `NAME=SOURCE`."""
    name, sep, source = text.partition("=")
    if not sep:
        name, source = os.path.basename(text.rstrip("/")), text
    if not name or not source:
        raise ValueError(f"--model {text!r}: expected SOURCE or NAME=SOURCE")
    return GroupSpec(name, source, engine_args)


def read_models_file(path: str, engine_args: tuple[str, ...]) -> list[GroupSpec]:
    """A JSON list of {"name", "model", "args": [launcher flags]} ("name" defaults to the
    model's base name; "args" come after the command line's engine flags)."""
    try:
        with open(path) as f:
            entries = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--models-file {path}: {exc}") from None
    if not isinstance(entries, list) or not all(isinstance(e, dict) and "model" in e
                                                for e in entries):
        raise ValueError(f"--models-file {path}: expected a JSON list of objects with \"model\"")
    return [GroupSpec(e.get("name") or os.path.basename(str(e["model"]).rstrip("/")),
                      str(e["model"]), engine_args + tuple(str(a) for a in e.get("args", ())))
            for e in entries]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagedserve serve (router)", description=__doc__)
    p.add_argument("--model", action="append", default=[], help="SOURCE or NAME=SOURCE; repeat")
    p.add_argument("--models-file", default=None)
    p.add_argument("--engine-url", action="append", default=[], help="a running engine; repeat")
    p.add_argument("--data-parallel-size", type=int, default=1)
    p.add_argument("--max-loaded-models", type=int, default=None)
    p.add_argument("--preload", action="append", default=[])
    p.add_argument("--api-key-file", default=None,
                   help="API keys, one KEY[:RPM[:TPM[:PRIORITY]]] a line, in a file of ours with "
                        "mode 0600 (default: $PAGEDSERVE_API_KEY, unlimited). PRIORITY: the "
                        "lowest (most urgent) priority the key's requests may ask for, lower "
                        "ones are raised to it (default 0)")
    p.add_argument("--api-key", action="append", default=[],
                   help="KEY[:RPM[:TPM[:PRIORITY]]]; repeat. Shows the key to every local user "
                        "(ps): prefer --api-key-file")
    p.add_argument("--rate-limit-burst", type=float, default=60.0,
                   help="seconds of a key's rate it may use at once")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--routing", default="affinity", help="affinity | round-robin")
    p.add_argument("--load-factor", type=float, default=1.25)
    p.add_argument("--load-floor", type=int, default=512)
    p.add_argument("--affinity-blocks", type=int, default=4)
    p.add_argument("--stall-timeout", type=float, default=60.0)
    p.add_argument("--load-timeout", type=float, default=300.0)
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--replica-wait", type=float, default=30.0)
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--die-with-parent", action="store_true")
    return p


def _block_size(engine_args: list[str]) -> int:
    for i, arg in enumerate(engine_args):
        if arg == "--block-size" and i + 1 < len(engine_args):
            return int(engine_args[i + 1])
        if arg.startswith("--block-size="):
            return int(arg.split("=", 1)[1])
    return 16


def config_from_argv(argv: list[str]) -> tuple[RouterConfig, bool]:
    """(config, die_with_parent); ValueError naming the bad flag."""
    ns, engine_args = build_parser().parse_known_args(argv)
    if ns.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be at least 1, got {ns.data_parallel_size}")
    if engine_args and ns.engine_url:
        raise ValueError(f"flags for local engine groups ({' '.join(engine_args)}) do not apply "
                         "to --engine-url engines")
    args = tuple(engine_args)
    specs = [parse_model(m, args) for m in ns.model]
    if ns.models_file:
        specs += read_models_file(ns.models_file, args)
    if not specs and not ns.engine_url:  # the model a plain launch serves
        specs = [parse_model(ModelArgs().model, args)]
    models: dict[str, GroupSpec] = {}
    for spec in specs:
        if spec.model in models:
            raise ValueError(f"model {spec.model!r} is given twice; name them NAME=SOURCE")
        models[spec.model] = spec
    keys = api_keys(ns.api_key, ns.api_key_file)
    cfg = RouterConfig(
        models=models, engine_urls=list(ns.engine_url), data_parallel_size=ns.data_parallel_size,
        max_loaded_models=ns.max_loaded_models, preload=list(ns.preload), api_keys=keys,
        burst_seconds=ns.rate_limit_burst, host=ns.host, port=ns.port, routing=ns.routing,
        load_factor=ns.load_factor, load_floor=ns.load_floor, block_size=_block_size(engine_args),
        affinity_blocks=ns.affinity_blocks, stall_timeout=ns.stall_timeout,
        load_timeout=ns.load_timeout, ready_timeout=ns.ready_timeout,
        replica_wait=ns.replica_wait, log_level=ns.log_level)
    return cfg, ns.die_with_parent
