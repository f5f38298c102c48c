"""LoRA serving settings (vLLM's flags), one dataclass read once from the command line."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(slots=True)
class LoRAArgs:
    """--enable-lora turns adapters on. `max_loras` adapters run in one step (slots resident on
    the device); `max_cpu_loras` are kept loaded in host memory (least recently used evicted);
    `max_lora_rank` bounds every adapter's rank (the slots are sized by it). `lora_modules`:
    "name=path" adapters loaded at start."""

    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_modules: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, "
                                 f"got {value!r}")
        if self.max_lora_rank not in MAX_LORA_RANKS:
            raise ValueError(f"--max-lora-rank must be one of "
                             f"{', '.join(map(str, MAX_LORA_RANKS))}, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"--max-cpu-loras ({self.max_cpu_loras}) must be at least "
                             f"--max-loras ({self.max_loras})")
        for entry in self.lora_modules:
            parse_lora_module(entry)
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")

    @property
    def cpu_slots(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    @property
    def device_slots(self) -> int:
        """Adapters one step may use: 0 with LoRA off."""
        return self.max_loras if self.enable_lora else 0


def parse_lora_module(entry: str) -> tuple[str, str]:
    """"name=path" -> (name, path), or vLLM's JSON form {"name": .., "path": ..}."""
    if entry.lstrip().startswith("{"):
        import json
        try:
            spec = json.loads(entry)
            return str(spec["name"]), str(spec["path"])
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"--lora-modules: {entry!r} is not a JSON object with name and "
                             f"path") from None
    name, sep, path = entry.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"--lora-modules: expected name=path, got {entry!r}")
    return name.strip(), path.strip()


def add_lora_args(parser: argparse.ArgumentParser, defaults: LoRAArgs) -> None:
    parser.add_argument("--enable-lora", action="store_true",
                        help="serve LoRA adapters (and allow /v1/load_lora_adapter)")
    parser.add_argument("--max-loras", type=int, default=defaults.max_loras,
                        help="adapters one step may use (resident slots)")
    parser.add_argument("--max-lora-rank", type=int, default=defaults.max_lora_rank)
    parser.add_argument("--max-cpu-loras", type=int, default=None,
                        help="adapters kept in host memory (default: --max-loras)")
    parser.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                        help="adapters served from the start, by name")


def lora_argv(args: LoRAArgs) -> list[str]:
    """The flags that give a launcher these settings (EngineGroup starts one)."""
    if not args.enable_lora:
        return []
    argv = ["--enable-lora", "--max-loras", str(args.max_loras),
            "--max-lora-rank", str(args.max_lora_rank)]
    if args.max_cpu_loras is not None:
        argv += ["--max-cpu-loras", str(args.max_cpu_loras)]
    if args.lora_modules:
        argv += ["--lora-modules", *args.lora_modules]
    return argv
