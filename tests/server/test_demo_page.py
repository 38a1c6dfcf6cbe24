"""The demo page in headless Chromium (Debian's binary, driven by Playwright): streamed text, live stats, stop."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.server.conftest import API_KEY

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "Debian's chromium is required (make test installs it)"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def page(browser, server):
    page = browser.new_page(viewport={"width": 1200, "height": 800})
    page.goto(server.url + "/")
    yield page
    page.close()


def test_send_streams_text_and_shows_stats(page, server):
    page.wait_for_function("document.getElementById('model-name').textContent.includes('SmolLM2')")
    page.fill("#prompt", "What is the capital of France?")
    page.fill("#temperature", "0")
    page.click("#send")
    bubble = page.locator(".msg.assistant").last
    # While streaming the stop button is live and the bubble grows.
    page.wait_for_function(
        "document.querySelector('.msg.assistant') && document.querySelector('.msg.assistant').textContent.length > 0"
    )
    page.wait_for_function("!document.querySelector('.msg.assistant.streaming')", timeout=60_000)
    assert "Paris" in bubble.text_content()
    assert page.text_content("#stat-ttft").endswith("ms")
    assert float(page.text_content("#stat-tps")) > 0
    assert int(page.text_content("#stat-tokens")) > 0
    page.wait_for_function("document.getElementById('stat-kv').textContent.includes('%')")
    assert page.text_content("#stat-running") in {"0", "1"}
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "demo-page.png"))
    server.wait_idle()


def test_stop_button_aborts_the_request(page, server):
    page.fill("#max-tokens", "2000")
    page.fill("#prompt", "Write a very long story about a dragon and a knight.")
    page.click("#send")
    page.wait_for_function(
        "(document.querySelector('.msg.assistant:last-child') || {}).textContent?.length > 20", timeout=60_000
    )
    page.click("#stop")
    page.wait_for_function("document.querySelector('.msg.assistant:last-child .meta')?.textContent === 'stopped'")
    assert page.is_enabled("#send") and not page.is_enabled("#stop")
    server.wait_idle(timeout=10)  # the abort freed the request's blocks
    page.screenshot(path=str(ARTIFACTS / "demo-page-stopped.png"))


def test_without_api_key_the_key_field_stays_hidden(page):
    page.wait_for_function("document.getElementById('model-name').textContent.includes('SmolLM2')")
    assert not page.is_visible("#api-key")


def test_api_key_mode_asks_for_the_key_and_keeps_it(browser, secured_server):
    context = browser.new_context(viewport={"width": 1200, "height": 800})
    page = context.new_page()
    page.goto(secured_server.url + "/")
    page.wait_for_selector("#api-key", state="visible")  # the server says it needs a key
    page.fill("#prompt", "Hi")
    page.click("#send")
    page.wait_for_function("document.querySelector('.msg.assistant.error')?.textContent.includes('API key')")
    page.fill("#api-key", API_KEY)
    page.fill("#max-tokens", "8")
    page.fill("#prompt", "What is the capital of France?")
    page.click("#send")
    page.wait_for_function("!document.querySelector('.msg.assistant.streaming')", timeout=60_000)
    answer = page.locator(".msg.assistant").last
    assert "error" not in (answer.get_attribute("class") or "") and answer.text_content()
    page.reload()  # the key survives a reload: it is kept in the page's local storage
    page.wait_for_selector("#api-key", state="visible")
    assert page.input_value("#api-key") == API_KEY
    page.screenshot(path=str(ARTIFACTS / "demo-page-api-key.png"))
    context.close()
