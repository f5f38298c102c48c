"""The files of a Hugging Face checkpoint directory: its JSON files and its safetensors shards.

Below both readers of a checkpoint: the loader (workers/loader.py) and the AWQ/GPTQ reader
(workers/int4_checkpoints.py), which the loader calls.
"""
from __future__ import annotations

import json
from pathlib import Path

from pagedserve.pipeline.load_error import ModelLoadError


def read_json(path: Path, model_dir: Path, what: str) -> dict:
    """The JSON object in `path`; ModelLoadError naming `model_dir` and `what` when it is
    missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise ModelLoadError(f"{model_dir}: no {what} in this directory") from e
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{model_dir}: {what} is unreadable or not JSON ({e})") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{model_dir}: {what} must hold a JSON object")
    return data


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files holding the weights (the shard index's files when there is one)."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index, model_dir, index.name).get("weight_map") or {}
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing or not files:
            raise ModelLoadError(f"{model_dir}: {index.name} lists missing shards "
                                 f"{missing or '(none listed)'}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(
            p.name for p in model_dir.glob("*.pt*"))
        hint = f" (found {', '.join(others)}; only safetensors are supported)" if others else ""
        raise ModelLoadError(f"{model_dir}: no *.safetensors weight files{hint}")
    return files
