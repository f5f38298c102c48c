"""The web page in a real headless chromium against a real engine group on a tiny random model
(`--api-key`): the key asked for, answers streamed, a stop that aborts the request on the
server, JSON-schema mode, the engine panel under load, a killed worker's restart counted; and
the router serving the same page across two models' replicas, the model switched."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from e2e.router_group import Router, metric, scrape
from faults.conftest import Group
from pagedserve.pipeline.ingress.testing import make_tiny_tokenizer
from pagedserve.workers.testing import make_tiny_llama

pytestmark = pytest.mark.slow

KEY = "webui-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ABORTED = ("vllm:request_success_total", {"finished_reason": "abort"})


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A random 2-layer Llama with a byte tokenizer: any text is valid, steps take ~ms."""
    path = make_tiny_llama(tmp_path_factory.mktemp("webui-tiny"), seed=5, vocab_size=259)
    tokenizer = make_tiny_tokenizer()
    tokenizer.save_pretrained(path)
    # the model ends on the tokenizer's special end token, as a real chat model does (not on
    # byte 2, whose text a grammar's end would leave in a JSON answer)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((path / name).read_text())
        config["eos_token_id"] = tokenizer.eos_token_id
        (path / name).write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def server(tiny_dir):
    group = Group(tiny_dir, http=True, extra=("--api-key", KEY, "--served-model-name", "tiny"))
    group.base = f"http://127.0.0.1:{group.port}"
    yield group
    assert group.close() == 0
    assert group.leftovers() == []


def open_page(page, base: str, key: str | None = KEY):
    page.goto(f"{base}/")
    if key is not None:
        page.fill("#api-key", key)
        page.press("#api-key", "Enter")
        page.wait_for_function("document.querySelectorAll('#model option').length > 0")
    return page


def set_sampling(page, **values) -> None:
    for name, value in values.items():
        page.fill(f"#{name}", str(value))
    page.dispatch_event("#settings", "change")


def send(page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def last_answer(page) -> str:
    return page.inner_text("#messages li.assistant:last-child .content")


def wait_answered(page, timeout_s: float = 60) -> None:
    page.wait_for_function("!document.getElementById('send').disabled "
                           "&& document.getElementById('stop').disabled", timeout=timeout_s * 1000)


def test_the_key_is_asked_and_an_answer_streams_in(server, page):
    page.goto(f"{server.base}/")  # the page itself loads without the key ...
    page.wait_for_function("document.getElementById('status').textContent.includes('API key')")
    assert httpx.get(f"{server.base}/engine/state").status_code == 401  # ... its data does not
    open_page(page, server.base)
    assert page.eval_on_selector_all("#model option", "os => os.map(o => o.value)") == ["tiny"]
    set_sampling(page, temperature=0, max_tokens=300, min_tokens=300)
    # every length the answer's text had, as the page re-rendered it
    page.evaluate("""() => { window.lengths = new Set();
        new MutationObserver(() => { const c = document.querySelector(
            '#messages li.assistant:last-child .content');
            if (c) window.lengths.add(c.textContent.length); })
        .observe(document.getElementById('messages'), {childList: true, subtree: true}); }""")
    send(page, "Hello there")
    wait_answered(page)
    lengths = sorted(page.evaluate("[...window.lengths]"))
    assert len([n for n in lengths if n > 0]) >= 3, f"no tokens streamed in: {lengths}"
    stats = page.inner_text("#chat-stats")
    assert "answer 300 tokens" in stats and "tokens/s" in stats, stats
    assert "prompt " in stats and "finished: length" in stats, stats
    # the conversation is kept in the browser
    answer = last_answer(page)
    page.reload()
    page.wait_for_selector("#messages li.assistant")
    assert page.inner_text("#messages li.user .content") == "Hello there"
    assert last_answer(page) == answer


def test_stop_aborts_the_request_on_the_server(server, page):
    open_page(page, server.base)
    before = metric(scrape(f"{server.base}/metrics"), ABORTED[0], **ABORTED[1])
    set_sampling(page, temperature=0, max_tokens=1800, min_tokens=1800)
    send(page, "Tell me a long story")
    page.wait_for_function("(document.querySelector('#messages li.assistant:last-child .content')"
                           " || {textContent: ''}).textContent.length > 20")
    page.click("#stop")
    page.wait_for_selector("#messages li.assistant.stopped")
    assert "finished: stopped" in page.inner_text("#chat-stats")
    deadline = time.monotonic() + 5
    while True:  # 1800 tokens take over 10 s here: only an abort ends the request this soon
        samples = scrape(f"{server.base}/metrics")
        if (metric(samples, ABORTED[0], **ABORTED[1]) == before + 1
                and metric(samples, "vllm:num_requests_running") == 0):
            break
        assert time.monotonic() < deadline, "the stopped request was not aborted on the server"
        time.sleep(0.1)


def test_json_schema_mode_and_rendering(server, page):
    open_page(page, server.base)
    set_sampling(page, temperature=1, max_tokens=200, min_tokens=0)
    page.check("#json-mode")
    # an enum: the random model's answer ends within max_tokens
    page.fill("#json-schema", json.dumps({"type": "object", "required": ["answer"],
                                          "properties": {"answer": {"enum": ["yes", "no"]}}}))
    page.dispatch_event("#settings", "change")
    send(page, "Answer in JSON")
    wait_answered(page)
    kept = page.evaluate("JSON.parse(localStorage.getItem('pagedserve.chat')).messages.at(-1)")
    assert kept.get("finish_reason") == "stop" and not kept.get("error"), kept
    try:
        assert json.loads(kept["content"])["answer"] in ("yes", "no"), kept
    except ValueError:
        pytest.fail(f"the answer is not JSON: {kept!r}")
    # the renderer and the chunk parser, in the page's own modules
    html = page.evaluate("""async () => { const md = await import('/webui/markdown.js');
        return md.renderMarkdown(
            '# T\\n**b** <script>x</script>\\n```python\\ndef f(): return 1\\n```'); }""")
    assert "<strong>b</strong>" in html and "&lt;script&gt;" in html and "<script>" not in html
    assert '<span class="hl-keyword">def</span>' in html and "<h3>T</h3>" in html
    loose = page.evaluate("async () => (await import('/webui/markdown.js'))"
                          ".renderMarkdown('1. a\\n\\n2. b\\n   c')")
    assert loose == "<ol><li>a</li><li>b<br>c</li></ol>"  # one list across the blank line
    message = page.evaluate("""async () => { const chat = await import('/webui/chat.js');
        const m = {content: ''};
        for (const c of [{choices: [{delta: {reasoning_content: 'think'}}]},
                         {choices: [{delta: {tool_calls: [{index: 0, id: 'c1',
                            function: {name: 'get', arguments: '{"a"'}}]}}]},
                         {choices: [{delta: {tool_calls: [{index: 0,
                            function: {arguments: ': 1}'}}]},
                                     finish_reason: 'tool_calls'}]}]) chat.applyChunk(m, c);
        return m; }""")
    assert message["reasoning"] == "think" and message["finish_reason"] == "tool_calls"
    assert message["tool_calls"][0]["function"] == {"name": "get", "arguments": '{"a": 1}'}


def _load(base: str, stop: threading.Event, streams: int = 4) -> list[threading.Thread]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "load"}], "stream": True,
            "max_tokens": 400, "min_tokens": 400}

    def run() -> None:
        while not stop.is_set():
            with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, headers=AUTH,
                              timeout=60) as r:
                for _ in r.iter_lines():
                    if stop.is_set():
                        break
    threads = [threading.Thread(target=run, daemon=True) for _ in range(streams)]
    for t in threads:
        t.start()
    return threads


def cell(page, process: str, column: int) -> str:
    return page.evaluate(f"""() => {{ for (const tr of document.querySelectorAll(
        '#processes tbody tr')) if (tr.cells[1].textContent === '{process}')
        return tr.cells[{column}].textContent; return null; }}""")


def test_engine_panel_moves_under_load_and_counts_a_restart(server, page):
    open_page(page, server.base)
    page.click("#tab-engine")
    assert page.is_hidden("#view-chat") and page.is_visible("#chart-tokens")
    stop = threading.Event()
    threads = _load(server.base, stop)
    try:
        page.wait_for_function("Number(document.querySelector('[data-metric=running]')"
                               ".textContent) >= 2", timeout=30_000)
        first = page.inner_text("[data-metric=tokens]")
        page.wait_for_function(f"document.querySelector('[data-metric=tokens]').textContent"
                               f" !== {json.dumps(first)}", timeout=10_000)
        assert float(page.inner_text("[data-metric=tokens_per_step]")) >= 1
        assert page.inner_text("[data-metric=kv]").endswith("blocks)")
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    # the tokens chart has drawn its lines (pixels of the "out" colour)
    assert page.evaluate("""() => { const c = document.getElementById('chart-tokens');
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        for (let i = 0; i < d.length; i += 4) if (d[i] === 214 && d[i + 1] === 85) return true;
        return false; }""")
    assert cell(page, "worker0", 2) == str(server.pid_of("worker0"))
    assert cell(page, "worker0", 4) == "0"
    new_pid = server.wait_restarted("worker0", server.kill("worker0"))
    page.wait_for_function(f"""() => [...document.querySelectorAll('#processes tbody tr')]
        .some(tr => tr.cells[1].textContent === 'worker0' && tr.cells[2].textContent === '{new_pid}'
                    && tr.cells[4].textContent === '1')""", timeout=30_000)
    assert {cell(page, name, 4) for name in ("scheduler", "detokenizer", "ingress")} == {"0"}


def test_router_serves_the_page_across_models_and_replicas(tiny_dir, browser):
    router = Router("--model", f"a={tiny_dir}", "--model", f"b={tiny_dir}", "--api-key", KEY)
    try:
        phone = browser.new_page(viewport={"width": 390, "height": 844}, bypass_csp=True)
        page = open_page(phone, router.base)
        # a phone's width: nothing wider than the screen
        assert page.evaluate("document.documentElement.scrollWidth") <= 390
        options = page.eval_on_selector_all("#model option", "os => os.map(o => o.value)")
        assert options == ["a", "b"]
        page.select_option("#model", "b")
        set_sampling(page, temperature=0, max_tokens=8, min_tokens=8)
        send(page, "hi")
        wait_answered(page)
        assert page.inner_text("#messages li.assistant .who") == "b"
        assert "answer 8 tokens" in page.inner_text("#chat-stats")
        assert metric(router.metrics(), "router_requests_total", model="b") == 1
        assert metric(router.metrics(), "router_requests_total", model="a") == 0
        page.click("#tab-engine")
        page.wait_for_function("document.querySelectorAll('#replicas tbody tr').length === 2")
        rows = page.eval_on_selector_all("#replicas tbody tr",
                                         "rs => rs.map(r => [...r.cells].map(c => c.textContent))")
        assert [(r[0], r[2]) for r in rows] == [("a/0", "healthy"), ("b/0", "healthy")]
        page.wait_for_function("document.querySelectorAll('#processes tbody tr').length === 11")
        engines = page.eval_on_selector_all("#processes tbody tr",
                                            "rs => rs.map(r => r.cells[0].textContent)")
        assert engines.count("router") == 1 and engines.count("a/0") == engines.count("b/0") == 5
        assert httpx.get(f"{router.base}/engine/state").status_code == 401
        page.close()
    finally:
        assert router.close() == 0
    assert router.leftovers() == []
