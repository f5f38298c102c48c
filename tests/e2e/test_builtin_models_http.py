"""The openai SDK against a launched group of each new built-in model (issue #20): Qwen2.5-Coder's
chat (streamed and not), n=2 with logprobs, stop strings, greedy equal to transformers; Gemma 3
270M, a base model without a chat template: completions served, chat answered 400 naming the
missing template."""
from __future__ import annotations

import httpx
import openai
import pytest

from pagedserve.pipeline.tokenizer import load_tokenizer
from pagedserve.workers.loader import resolve_model
from pagedserve.workers.testing import hf_greedy
from tests.faults.conftest import Group

pytestmark = pytest.mark.slow


def serve(name: str, *extra: str):
    model_dir = resolve_model(name)
    # a request without max_tokens reserves the whole context: 2,048 tokens fit the test's cache
    group = Group(model_dir, http=True,
                  extra=("--served-model-name", name, "--max-model-len", "2048", *extra))
    sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{group.port}/v1", api_key="none",
                        max_retries=0, timeout=300)
    return group, sdk, model_dir


def check_completions(sdk, model: str, model_dir, prompt: str) -> None:
    tokenizer = load_tokenizer(model_dir)
    expected = hf_greedy(model_dir, [tokenizer.encode(prompt)], max_new_tokens=12)[0]
    greedy = sdk.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True, "repetition_penalty": 1.0})
    assert greedy.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
    two = sdk.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0.8,
                                 seed=5, n=2, logprobs=2)
    assert [c.index for c in two.choices] == [0, 1]
    assert all(len(c.logprobs.token_logprobs) == 8 for c in two.choices)
    text = greedy.choices[0].text
    stop = text[3:6]
    cut = sdk.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0,
                                 stop=[stop], extra_body={"repetition_penalty": 1.0})
    assert cut.choices[0].text == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_qwen_chat_streaming_n2_logprobs_stop():
    name = "Qwen2.5-Coder-0.5B-Instruct"
    group, sdk, model_dir = serve(name)
    try:
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        answer = sdk.chat.completions.create(model=name, messages=messages)   # its defaults
        assert answer.choices[0].finish_reason == "stop"
        assert "Paris" in answer.choices[0].message.content
        chunks = list(sdk.chat.completions.create(model=name, messages=messages, stream=True,
                                                  temperature=0, max_tokens=24))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert "Paris" in streamed
        check_completions(sdk, name, model_dir, "def fibonacci(n):")
    finally:
        assert group.close() == 0


def test_gemma_base_model_serves_completions_and_refuses_chat():
    name = "gemma-3-270m"
    group, sdk, model_dir = serve(name, "--quantization", "none")   # greedy = transformers
    try:
        r = httpx.post(f"http://127.0.0.1:{group.port}/v1/chat/completions", timeout=60,
                       json={"model": name, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]
        check_completions(sdk, name, model_dir, "The capital of France is")
    finally:
        assert group.close() == 0
