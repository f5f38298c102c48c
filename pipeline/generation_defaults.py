"""The model's default sampling parameters (vLLM's `--generation-config`).

`auto` (the default) reads the model directory's generation_config.json (a converted GGUF's holds
its general.sampling.* values and, for a built-in, its authors' published defaults); `vllm` uses
none; any other value is a directory whose generation_config.json is read instead. The launcher
reads them once into `ModelInfo.generation_defaults`; the scheduler's admission fills a request's
unset fields from them (`SamplingParams.with_defaults`), so an explicit field always wins and the
HTTP ingress, the Python API and the ZMQ client all get the same defaults.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from pagedserve.pipeline.sampling_params import MODEL_DEFAULT_FIELDS, SamplingParams
from pagedserve.pipeline.load_error import ModelLoadError

MODES = ("auto", "vllm")


class GenerationConfigError(ModelLoadError):
    """--generation-config names no usable generation_config.json, or one with bad values."""


def read_generation_defaults(mode: str, model_dir: str | Path) -> tuple[dict, str]:
    """(defaults, where they came from) for --generation-config `mode`."""
    if mode == "vllm":
        return {}, "--generation-config vllm"
    folder = Path(model_dir) if mode == "auto" else Path(mode).expanduser()
    path = folder / "generation_config.json"
    if mode != "auto" and not path.is_file():
        raise GenerationConfigError(f"--generation-config {mode}: no generation_config.json in "
                                    f"that directory (or pass auto or vllm)")
    if not path.is_file():
        return {}, f"{path} does not exist"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise GenerationConfigError(f"{path}: unreadable or not JSON ({e})") from e
    if not isinstance(raw, dict):
        raise GenerationConfigError(f"{path}: must hold a JSON object")
    return pick_defaults(raw, str(path)), str(path)


def pick_defaults(raw: dict, where: str = "generation_config.json") -> dict:
    """The sampling fields of a generation_config.json, checked; other keys are ignored."""
    out = {}
    for name in MODEL_DEFAULT_FIELDS:
        value = raw.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not math.isfinite(value):
            raise GenerationConfigError(f"{where}: {name} must be a number, got {value!r}")
        out[name] = int(value) if name == "top_k" else float(value)
    if out.get("top_k") == 0:
        out["top_k"] = -1  # transformers' "no top-k"
    try:
        SamplingParams().with_defaults(out).validate()
    except ValueError as e:
        raise GenerationConfigError(f"{where}: {e}") from None
    return out


def describe(defaults: dict, source: str) -> str:
    """The launcher's log line."""
    if not defaults:
        return f"generation defaults: none ({source}); unset request fields take neutral values"
    shown = " ".join(f"{k}={v:g}" for k, v in defaults.items())
    return (f"generation defaults from {source}: {shown} (a request's unset fields take them; "
            f"--generation-config vllm turns them off)")
