"""The demo page in headless Chromium (Debian's binary, driven by Playwright): streamed text, live stats, stop."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

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
def page(server):
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "Debian's chromium is required (make test installs it)"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1200, "height": 800})
        page.goto(server.url + "/")
        yield page
        browser.close()


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
