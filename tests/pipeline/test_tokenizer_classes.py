"""pipeline.tokenizer: a tokenizer loaded through the class AutoTokenizer picked before (recorded
in the cache) is the same tokenizer, and loading it that way does not import torch."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from pagedserve.pipeline.detokenizer.incremental import special_token_ids
from pagedserve.pipeline.tokenizer import load_tokenizer
from pagedserve.workers.loader import resolve_model

from pagedserve import envs

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris? <|im_start|> ünï 🤖"}]
TEXT = "Hello <|im_end|> wörld!\n\tdef f(x): return x  # 日本語 <bos><eos>"


@pytest.mark.parametrize("name", ["SmolLM2-135M-Instruct", "Qwen2.5-Coder-0.5B-Instruct",
                                  "gemma-3-270m"])
def test_the_recorded_class_loads_the_same_tokenizer(name, tmp_path):
    model_dir = resolve_model(name)
    with envs.override(cache_dir=str(tmp_path)):
        auto = load_tokenizer(model_dir)                      # AutoTokenizer; class recorded
        [entry] = (tmp_path / "tokenizer-classes").iterdir()
        direct = load_tokenizer(model_dir)
    assert type(direct) is type(auto) and entry.is_file()
    for special in (True, False):
        assert direct.encode(TEXT, add_special_tokens=special) == auto.encode(
            TEXT, add_special_tokens=special)
    ids = auto.encode(TEXT)
    assert direct.decode(ids, skip_special_tokens=True) == auto.decode(ids, skip_special_tokens=True)
    assert special_token_ids(direct) == special_token_ids(auto)
    assert (direct.eos_token_id, direct.bos_token_id) == (auto.eos_token_id, auto.bos_token_id)
    assert direct.chat_template == auto.chat_template
    if auto.chat_template:
        for tools in (None, TOOLS):
            assert direct.apply_chat_template(CHAT, tools=tools, tokenize=False,
                                              add_generation_prompt=True) == \
                auto.apply_chat_template(CHAT, tools=tools, tokenize=False,
                                         add_generation_prompt=True)


def test_loading_through_the_recorded_class_does_not_import_torch(tmp_path):
    model_dir = resolve_model("SmolLM2-135M-Instruct")
    with envs.override(cache_dir=str(tmp_path)):
        load_tokenizer(model_dir)
    code = textwrap.dedent(f"""
        import sys
        from pagedserve.pipeline.tokenizer import load_tokenizer
        tokenizer = load_tokenizer({str(model_dir)!r})
        print(len(tokenizer.encode("hello")) > 0, "torch" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PAGEDSERVE_CACHE": str(tmp_path)})
    assert out.stdout.split() == ["True", "False"]
