"""Our tokenizers against llama.cpp's, the independent reference for a GGUF's vocabulary.

llama-server (the binary scripts/llama_server_build.py caches) loads the GGUF itself and answers
/tokenize and /detokenize on 127.0.0.1; the texts are ShareGPT turns (scripts/sharegpt.py), with
CJK and emoji among them. A text agrees when our ids equal llama.cpp's and our decoding of
llama.cpp's ids equals its own. Requests go out from a few threads over kept-alive connections.

    .venv/bin/python scripts/tokenizer_reference.py --model Qwen2.5-Coder-0.5B-Instruct --texts 1000
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af]")
_EMOJI = re.compile(r"[\U0001F300-\U0001FAFF\u2600-\u27bf]")
MAX_CHARS = 4000  # longer turns are cut: the property is per character, not per length


def llama_server_binary() -> Path | None:
    """The cached llama-server (any version), or None when none was built on this machine."""
    from pagedserve import envs
    found = sorted((envs.current().cache_root / "llama.cpp").glob("*/llama-server"))
    return found[-1] if found else None


def sharegpt_texts(count: int, *, path: str | Path | None = None, min_cjk: int = 50,
                   min_emoji: int = 50) -> list[str]:
    """`count` ShareGPT turns in file order, at least min_cjk with CJK and min_emoji with emoji
    (found further into the file when the first turns hold too few)."""
    import sharegpt
    plain, cjk, emoji = [], [], []
    for entry in sharegpt.iter_entries(path):
        for turn in entry.get("conversations") or []:
            text = (turn.get("value") or "")[:MAX_CHARS]
            if not text.strip():
                continue
            if _CJK.search(text) and len(cjk) < min_cjk:
                cjk.append(text)
            elif _EMOJI.search(text) and len(emoji) < min_emoji:
                emoji.append(text)
            elif len(plain) < count - min_cjk - min_emoji:
                plain.append(text)
        if len(cjk) >= min_cjk and len(emoji) >= min_emoji and \
                len(plain) >= count - min_cjk - min_emoji:
            break
    return (cjk + emoji + plain)[:count]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """llama-server over one GGUF on 127.0.0.1, started for tokenizing (tiny context, 1 thread)."""

    def __init__(self, binary: Path, gguf: Path, *, timeout: float = 180.0) -> None:
        self.binary, self.gguf, self.timeout = binary, gguf, timeout
        self.port = _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log = tempfile.TemporaryFile()

    def __enter__(self) -> "LlamaServer":
        import httpx
        cmd = [str(self.binary), "-m", str(self.gguf), "--host", "127.0.0.1", "--port",
               str(self.port), "-c", "256", "-t", "1", "-tb", "1", "-np", "1", "--no-warmup"]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.client = httpx.Client(base_url=self.base_url, timeout=60)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}: "
                                   f"{self._log_tail()}")
            try:
                if self.client.get("/health").status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"llama-server was not healthy within {self.timeout:.0f} s")

    def _log_tail(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-2000:]

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.client.close()
        self.log.close()

    def tokenize(self, texts: list[str], threads: int = 4) -> list[list[int]]:
        def one(text: str) -> list[int]:
            r = self.client.post("/tokenize", json={"content": text, "add_special": False,
                                                    "parse_special": True})
            r.raise_for_status()
            return r.json()["tokens"]
        with ThreadPoolExecutor(threads) as pool:
            return list(pool.map(one, texts))

    def detokenize(self, ids: list[list[int]], threads: int = 4) -> list[str]:
        def one(tokens: list[int]) -> str:
            r = self.client.post("/detokenize", json={"tokens": tokens})
            r.raise_for_status()
            return r.json()["content"]
        with ThreadPoolExecutor(threads) as pool:
            return list(pool.map(one, ids))


@dataclass
class Agreement:
    texts: int = 0
    encode_equal: int = 0
    decode_equal: int = 0
    mismatches: list[dict] = field(default_factory=list)

    def summary(self) -> dict:
        return {"texts": self.texts, "encode_equal": self.encode_equal,
                "decode_equal": self.decode_equal, "first_mismatches": self.mismatches[:5]}


def compare(tokenizer, server: LlamaServer, texts: list[str]) -> Agreement:
    """Encode with both, decode llama.cpp's ids with both; count and keep what differs."""
    theirs = server.tokenize(texts)
    their_text = server.detokenize(theirs)
    ours = tokenizer(texts, add_special_tokens=False)["input_ids"]
    our_text = tokenizer.batch_decode(theirs, skip_special_tokens=False,
                                      clean_up_tokenization_spaces=False)
    result = Agreement(texts=len(texts))
    for text, a, b, da, db in zip(texts, ours, theirs, our_text, their_text):
        result.encode_equal += a == b
        result.decode_equal += da == db
        if a != b or da != db:
            first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            result.mismatches.append({"text": text[max(0, first - 20):first + 40],
                                      "ours": a[first:first + 6], "llama.cpp": b[first:first + 6],
                                      "decode_equal": da == db})
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a built-in name")
    ap.add_argument("--texts", type=int, default=1000)
    ap.add_argument("--tokenizer-dir", default=None, help="default: the converted built-in's")
    args = ap.parse_args(argv)
    from pagedserve.pipeline.tokenizer import load_tokenizer
    from pagedserve.workers.builtin_models import builtin_gguf
    from pagedserve.workers.loader import resolve_model, default_cache_dir
    binary = llama_server_binary()
    if binary is None:
        raise SystemExit("no cached llama-server: run scripts/compare_llama_server.py --build-only")
    tokenizer = load_tokenizer(args.tokenizer_dir or resolve_model(args.model))
    texts = sharegpt_texts(args.texts)
    with LlamaServer(binary, builtin_gguf(args.model, default_cache_dir())) as server:
        result = compare(tokenizer, server, texts)
    print(json.dumps({"model": args.model, **result.summary()}, ensure_ascii=False, indent=1))
    return 0 if result.encode_equal == result.decode_equal == result.texts else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
