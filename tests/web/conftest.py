"""A headless browser for the web page's tests: Debian's chromium, installed by
scripts/browser_setup.sh (skipped with its reason where it cannot be), driven by Playwright.
Nothing is fetched at run time: Playwright's own browser downloads are never used."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

BROWSER_SETUP = Path(__file__).resolve().parents[2] / "scripts" / "browser_setup.sh"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]


def chromium_path() -> str:
    """The browser's path; pytest.skip with the reason where it cannot be installed."""
    try:
        done = subprocess.run(["bash", str(BROWSER_SETUP)], capture_output=True, text=True,
                              timeout=900)
    except subprocess.TimeoutExpired:
        pytest.skip("scripts/browser_setup.sh did not finish within 900 s")
    if done.returncode != 0:
        pytest.skip(f"no headless chromium: {done.stderr.strip() or 'browser_setup.sh failed'}")
    return done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def browser():
    executable = chromium_path()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("the playwright package is not installed (pyproject's dev extra)")
    with sync_playwright() as playwright:
        # Playwright launches it with a fresh temporary profile (user data dir) of its own
        browser = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser):
    """A fresh browser context (its own localStorage) at a laptop's width."""
    # bypass_csp: the page forbids eval, which Playwright's wait_for_function uses
    context = browser.new_context(viewport={"width": 1280, "height": 900}, bypass_csp=True)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.errors = errors
    yield page
    context.close()
    assert errors == [], f"the page raised: {errors}"
