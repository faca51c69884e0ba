"""Shared by the metrics tests: Debian's headless Chromium driven by Playwright, launched as
tests/foundation/test_report_browser.py does (no browser download; flags that work as root),
with every request outside the page's own server refused."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@contextlib.contextmanager
def chromium_page(tmp_path: Path) -> Iterator:
    """A page of a fresh headless Chromium profile; requests to any host but 127.0.0.1 fail
    the test (the status page must be self-contained)."""
    if not CHROMIUM.exists():
        pytest.fail(
            f"{CHROMIUM} is missing: the browser test needs Debian's Chromium "
            "(apt-get install -y chromium; ./dev installs it for the test tier)"
        )
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("playwright is missing: pip install -e '.[test]'")
    outside: list[str] = []
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"),
            executable_path=str(CHROMIUM),
            args=FLAGS,
            headless=True,
            viewport={"width": 1400, "height": 900},
        )
        try:
            page = context.new_page()

            def route(r) -> None:
                if r.request.url.startswith("http://127.0.0.1:"):
                    r.continue_()
                else:
                    outside.append(r.request.url)
                    r.abort()

            page.route("**/*", route)
            yield page
        finally:
            context.close()
    assert outside == [], f"the status page fetched from outside its server: {outside}"
