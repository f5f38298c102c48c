"""Screenshots of the web page for the docs, taken against a real server in headless chromium:
docs/images/webui-chat.png (a streamed answer with code) and docs/images/webui-engine.png (the
engine panel after a minute of load).

    python scripts/webui_screenshots.py                       # launches the default model
    python scripts/webui_screenshots.py --base-url http://127.0.0.1:8000 --api-key KEY

The browser is Debian's chromium (scripts/browser_setup.sh installs it), driven by Playwright.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from first_request import launch, stop  # noqa: E402

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]
QUESTION = "Write a Python function that tells whether a number is prime, and explain it briefly."
LOAD_PROMPTS = ["Name three rivers in Europe.", "What is a hash map?", "Write a haiku about rain.",
                "Explain TCP in two sentences.", "List four prime numbers.", "What is Rust?"]


def chromium() -> str:
    done = subprocess.run(["bash", str(ROOT / "scripts" / "browser_setup.sh")],
                          capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"no headless chromium: {done.stderr.strip()}")
    return done.stdout.strip().splitlines()[-1]


def load(base: str, key: str, model: str, halt: threading.Event, streams: int) -> None:
    """`streams` clients sending short chats one after another until `halt`."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}

    def client(i: int) -> None:
        n = i
        while not halt.is_set():
            body = {"model": model, "max_tokens": 96, "messages": [
                {"role": "user", "content": LOAD_PROMPTS[n % len(LOAD_PROMPTS)]}]}
            httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=300)
            n += streams
    for i in range(streams):
        threading.Thread(target=client, args=(i,), daemon=True).start()


def chat_shot(page, base: str, key: str, out: Path) -> str:
    page.goto(f"{base}/")
    if key:
        page.fill("#api-key", key)
        page.press("#api-key", "Enter")
    page.wait_for_function("document.querySelectorAll('#model option').length > 0")
    page.fill("#system", "You are a concise programming assistant.")
    page.fill("#temperature", "0.2")
    page.fill("#max_tokens", "320")
    page.dispatch_event("#settings", "change")
    page.fill("#prompt", QUESTION)
    page.press("#prompt", "Enter")
    page.wait_for_function("document.getElementById('stop').disabled", timeout=600_000)
    page.evaluate("window.scrollTo(0, 0)")  # the header, the question and the answer's start
    page.screenshot(path=str(out / "webui-chat.png"))
    return page.input_value("#model")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a model to launch (default: the built-in default)")
    p.add_argument("--base-url", default=None, help="a running server instead of launching one")
    p.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY", ""))
    p.add_argument("--load-seconds", type=float, default=60.0)
    p.add_argument("--streams", type=int, default=6)
    p.add_argument("--out", default=str(ROOT / "docs" / "images"))
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    proc, base = (None, args.base_url.rstrip("/")) if args.base_url else launch(
        args.model or "Qwen2.5-Coder-0.5B-Instruct", [], 900)
    halt = threading.Event()
    from playwright.sync_api import sync_playwright
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=chromium(), args=CHROMIUM_ARGS)
            # bypass_csp: the page forbids eval, which wait_for_function uses
            page = browser.new_page(viewport={"width": 1280, "height": 860}, bypass_csp=True)
            model = chat_shot(page, base, args.api_key, out)
            load(base, args.api_key, model, halt, args.streams)
            page.click("#tab-engine")
            time.sleep(args.load_seconds)
            page.screenshot(path=str(out / "webui-engine.png"), full_page=True)
            browser.close()
    finally:
        halt.set()
        if proc is not None:
            stop(proc)
    print(f"wrote {out / 'webui-chat.png'} and {out / 'webui-engine.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
