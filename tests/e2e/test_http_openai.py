"""The official openai SDK against a launched group (ingress + scheduler + worker + detokenizer)."""
from __future__ import annotations

import threading

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from faults.conftest import Group
from pagedserve.workers.testing import hf_greedy, hf_prompt_logprobs

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(model_dir):
    # weights dequantized at load: greedy outputs are compared with transformers'
    group = Group(model_dir, http=True, extra=("--api-key", "sekret", "--quantization", "none"))
    base = f"http://127.0.0.1:{group.port}"
    sdk = openai.OpenAI(base_url=f"{base}/v1", api_key="sekret", max_retries=0, timeout=300)
    model = sdk.models.list().data[0].id
    yield group, base, sdk, model
    assert group.close() == 0
    assert group.leftovers() == []


def test_completion_greedy_equals_transformers(server, model_dir, tokenizer):
    _, _, sdk, model = server
    prompt = "The three primary colors are"
    expected = hf_greedy(model_dir, [tokenizer.encode(prompt)], max_new_tokens=16)[0]
    r = sdk.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0,
                               extra_body={"ignore_eos": True})
    assert r.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 16
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt))


def test_streaming_chat_with_usage_in_last_chunk(server):
    _, _, sdk, model = server
    stream = sdk.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=20, temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert any(c.choices and c.choices[0].finish_reason in ("stop", "length") for c in chunks)


def test_n2_logprobs_seed_and_stop(server):
    _, _, sdk, model = server
    kw = dict(model=model, prompt="Once upon a time", max_tokens=12, temperature=0.9, seed=1234)
    a = sdk.completions.create(n=2, logprobs=3, **kw)
    b = sdk.completions.create(n=2, logprobs=3, **kw)
    assert len(a.choices) == 2 and [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seed reproducibility
    lp = a.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 12
    # OpenAI: the top 3, plus the sampled token when it is not among them
    assert all(3 <= len(t) <= 4 for t in lp.top_logprobs)
    full = sdk.completions.create(model=model, prompt="Count: 1, 2, 3,", max_tokens=20, temperature=0)
    stop = full.choices[0].text[4:7]
    cut = sdk.completions.create(model=model, prompt="Count: 1, 2, 3,", max_tokens=20,
                                 temperature=0, stop=[stop])
    assert cut.choices[0].text == full.choices[0].text[: full.choices[0].text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_prompt_logprobs_equal_transformers(server, model_dir, tokenizer):
    """lm-evaluation-harness's loglikelihood request (echo, max_tokens 0, logprobs 1,
    temperature 0) and vLLM's prompt_logprobs on SmolLM2: every prompt token's logprob, and
    the top-N, equal transformers' log_softmax to 1e-3."""
    _, base, sdk, model = server
    prompt = "The quick brown fox jumps over the lazy dog, because it wanted to see the river."
    ids = tokenizer.encode(prompt)
    want = hf_prompt_logprobs(model_dir, ids)
    own = want.gather(1, __import__("torch").tensor(ids[1:]).unsqueeze(1)).squeeze(1).tolist()
    r = sdk.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                               temperature=0)
    choice = r.choices[0]
    assert choice.text == prompt and r.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.text_offset) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(own, abs=1e-3)
    best = want.max(dim=1).values.tolist()
    assert [max(top.values()) for top in lp.top_logprobs[1:]] == pytest.approx(best, abs=1e-3)
    r = httpx.post(f"{base}/v1/completions", headers={"Authorization": "Bearer sekret"},
                   timeout=120, json={"model": model, "prompt": ids, "max_tokens": 1,
                                      "temperature": 0, "prompt_logprobs": 3})
    assert r.status_code == 200, r.text
    entries = r.json()["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for pos in range(1, len(ids)):
        values, top = want[pos - 1].topk(3)
        expected = dict(zip(top.tolist(), values.tolist())) | {ids[pos]: own[pos - 1]}
        got = {int(t): e["logprob"] for t, e in entries[pos].items()}
        assert got == pytest.approx(expected, abs=1e-3)


def test_bad_requests_get_openai_errors_then_good_ones_work(server):
    group, base, sdk, model = server
    cases = [
        ({"model": model, "prompt": "hi", "max_tokens": 0}, 400),
        ({"model": model, "prompt": "hi", "temperature": 3}, 400),
        ({"model": "nope", "prompt": "hi"}, 404),
        ({"model": model, "prompt": [99999999]}, 400),
        ({"model": model, "prompt": "hi", "max_tokens": 10**9}, 400),
        ({"model": model}, 400),
        ({"model": model, "prompt": "hi there", "prompt_logprobs": 21}, 400),
        ({"model": model, "prompt": "hi there", "echo": True, "logprobs": 21}, 400),
        ({"model": model, "prompt": "hi there", "echo": True, "max_tokens": -1}, 400),
    ]
    headers = {"Authorization": "Bearer sekret"}
    for body, status in cases:
        r = httpx.post(f"{base}/v1/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == status, (body, r.text)
        assert set(r.json()["error"]) >= {"message", "type", "param", "code"}
        ok = httpx.post(f"{base}/v1/completions", headers=headers, timeout=120,
                        json={"model": model, "prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200
    assert httpx.post(f"{base}/v1/completions", json={"model": model, "prompt": "x"},
                      timeout=30).status_code == 401


def test_tokenize_detokenize_and_infill_without_fim_tokens(server, tokenizer):
    """vLLM's /tokenize and /detokenize behind the key; SmolLM2 has no FIM tokens, so /infill
    and `suffix` are a 400 naming the cause."""
    _, base, _, model = server
    headers = {"Authorization": "Bearer sekret"}
    assert httpx.post(f"{base}/tokenize", json={"prompt": "x"}, timeout=30).status_code == 401
    r = httpx.post(f"{base}/tokenize", headers=headers, timeout=60,
                   json={"model": model, "prompt": "Hello world", "return_token_strs": True})
    assert r.status_code == 200 and r.json()["tokens"] == tokenizer.encode("Hello world")
    assert r.json()["token_strs"] == tokenizer.convert_ids_to_tokens(r.json()["tokens"])
    r = httpx.post(f"{base}/detokenize", headers=headers, timeout=60,
                   json={"tokens": r.json()["tokens"]})
    assert r.json() == {"prompt": "Hello world"}
    r = httpx.post(f"{base}/detokenize", headers=headers, timeout=60, json={"tokens": [10**6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    for path, body in (("/infill", {"input_prefix": "def f(", "input_suffix": ")"}),
                       ("/v1/completions", {"prompt": "def f(", "suffix": ")"})):
        r = httpx.post(f"{base}{path}", headers=headers, timeout=60, json=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "fim_not_supported"


def test_metrics_parse_and_move(server):
    _, base, sdk, model = server

    def scrape() -> dict:
        text = httpx.get(f"{base}/metrics", timeout=30).text
        return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}

    before = scrape()
    sdk.completions.create(model=model, prompt="Hello there", max_tokens=5, temperature=0)
    after = scrape()
    for name in ("vllm:generation_tokens_total", "vllm:prompt_tokens_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count"):
        assert after[name] > before.get(name, 0), name
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert name in after


def test_50_streaming_clients_disconnect_and_blocks_return_to_zero(server):
    group, base, _, model = server
    started = threading.Semaphore(0)

    def stream(i: int) -> None:
        body = {"model": model, "prompt": f"Tell a very long story number {i}", "max_tokens": 1000,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=300,
                          headers={"Authorization": "Bearer sekret"}) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n == 1:
                    started.release()
                    return  # leaving the block closes the connection mid-stream

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for _ in threads:
        assert started.acquire(timeout=1)
    assert group.blocks_in_use() == 0
    assert group.client.stats()["num_unfinished_requests"] == 0


def test_a_message_no_role_handles_is_logged_counted_and_exported(server):
    """A frame the scheduler does not handle (a launcher's Heartbeat on the clients' socket) and
    one that does not decode are dropped, counted, and shown in /metrics; serving goes on."""
    import zmq

    from pagedserve import transport
    from pagedserve.pipeline import messages

    group, base, sdk, model = server
    ctx = zmq.Context()
    sock = transport.make_socket(ctx, zmq.DEALER, group.frontend, bind=False, identity=b"stray")
    try:
        transport.send(sock, messages.Heartbeat("nobody", 1))
        sock.send_multipart([b"NoSuchMessage", b"\x80"])

        def dropped() -> dict:
            text = httpx.get(f"{base}/metrics", timeout=30).text
            return {(s.labels["role"], s.labels["type"]): s.value
                    for fam in text_string_to_metric_families(text)
                    if fam.name == "pagedserve:unknown_messages" for s in fam.samples}

        import time
        deadline = time.monotonic() + 10
        while len(dropped()) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert dropped() == {("scheduler", "Heartbeat"): 1.0, ("scheduler", "NoSuchMessage"): 1.0}
        out = sdk.completions.create(model=model, prompt="Hi", max_tokens=2, temperature=0)
        assert out.choices[0].finish_reason == "length"
    finally:
        sock.close(0)
        ctx.term()


def test_deploy_dashboard_and_hpa_metrics_are_exported(server):
    """Every series the Grafana dashboard and the HPA (through prometheus-adapter's rules) in
    deploy/ query is one this running engine exports."""
    from deploy.deploy_files import exported_series, missing_from, used_metric_names
    _, base, sdk, model = server
    sdk.completions.create(model=model, prompt="Hi", max_tokens=2, temperature=0)
    exported = exported_series(httpx.get(f"{base}/metrics", timeout=30).text)
    used = used_metric_names()
    assert "vllm:num_requests_waiting" in used
    assert missing_from(exported, used) == set()
